"""The server rows of bench/decode_cpu.py (--concurrent N), through the official openai
client against one `kie_engine serve` (continuous batching, its default --max-batch):

- one streamed request alone against N streamed at once, rounds alternating which goes
  first; aggregate completion tokens/s = completion tokens / (first request sent to last
  token received); every request asks for the same number of tokens (ignore_eos);
- each request's greedy text when it ran beside others against its text alone;
- time to first token of a request sent while N - 1 others decode, against the idle
  figure (the requests alone);
- the server's batch-size histogram (/metrics) at the end.

The client runs on the cores the server needs, so how it reads a stream is part of what
is measured.  "raw" (the default) reads the events through the openai client's raw
streaming response (`with_streaming_response`) and json.loads each one; "typed" iterates
the client's `Stream` of ChatCompletionChunk objects, whose per-chunk parse takes more
than twice the CPU (bench/RESULTS.md).  Both read every event as it arrives; both rows of a run use the
same one."""
import json
import threading
import time

PROMPTS = ["Explain how a bicycle works.", "Write a short poem about the sea.",
           "Give me three tips for learning to play the guitar.", "What is the capital of France?",
           "Describe a sunrise over the mountains.", "How do bees make honey?",
           "Tell me a story about a lost cat.", "Why is the sky blue?"]


def _client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _stream(client, model, prompt, tokens, out, key, gate=None, reader="raw"):
    """One streamed chat completion: out[key] = (text, completion tokens, t0, first, end);
    gate (an Event) is set once 8 pieces of text have come."""
    t0 = time.perf_counter()
    first, text, n, pieces = None, [], 0, 0
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0,
              stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})

    def took(content, usage):
        nonlocal first, pieces, n
        if content:
            first = first or time.perf_counter()
            text.append(content)
            pieces += 1
            if gate is not None and pieces == 8:
                gate.set()
        if usage:
            n = usage

    if reader == "typed":
        for ch in client.chat.completions.create(**kw):
            took(ch.choices[0].delta.content if ch.choices else None, ch.usage and ch.usage.completion_tokens)
    else:
        with client.chat.completions.with_streaming_response.create(**kw) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])
                if "error" in ch:
                    raise RuntimeError(f"the server ended the stream with an error: {ch['error']}")
                took(ch["choices"][0]["delta"].get("content") if ch["choices"] else None,
                     (ch.get("usage") or {}).get("completion_tokens"))
    out[key] = ("".join(text), n, t0, first, time.perf_counter())


def _together(client, model, prompts, tokens, late=None, reader="raw"):
    """prompts at once (threads); with late, that prompt is sent once every other one has
    8 pieces of text.  {index: result}, and the late one under key "late"."""
    out, gates, threads = {}, [], []
    for i, p in enumerate(prompts):
        g = threading.Event() if late is not None else None
        gates.append(g)
        threads.append(threading.Thread(target=_stream, args=(client, model, p, tokens, out, i, g, reader)))
    for t in threads:
        t.start()
    if late is not None:
        for g in gates:
            g.wait(600)
        t = threading.Thread(target=_stream, args=(client, model, late, tokens, out, "late", None, reader))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return out


def rounds(url, model, n, tokens, nrounds, log=print, reader="raw"):
    client = _client(url)
    prompts = (PROMPTS * ((n + len(PROMPTS) - 1) // len(PROMPTS)))[:n]
    alone_text = {}
    for i, p in enumerate(dict.fromkeys(prompts)):  # each prompt's text alone, once
        out = {}
        _stream(client, model, p, tokens, out, 0, reader=reader)
        alone_text[p] = out[0][0]
    alone, together, ttft_idle, ttft_mid, same = [], [], [], [], []
    for r in range(nrounds):
        for which in (("alone", "together") if r % 2 == 0 else ("together", "alone")):
            if which == "alone":
                out = {}
                _stream(client, model, prompts[r % n], tokens, out, 0, reader=reader)
                text, k, t0, first, end = out[0]
                alone.append(k / (end - t0))
                ttft_idle.append(first - t0)
                log(f"round {r}: one request alone: {alone[-1]:.1f} tokens/s, time to first token {1e3 * ttft_idle[-1]:.0f} ms")
            else:
                out = _together(client, model, prompts, tokens, reader=reader)
                t0 = min(v[2] for v in out.values())
                end = max(v[4] for v in out.values())
                together.append(sum(v[1] for v in out.values()) / (end - t0))
                same.append(all(out[i][0] == alone_text[prompts[i]] for i in range(n)))
                log(f"round {r}: {n} at once: {together[-1]:.1f} tokens/s aggregate, texts as alone: {same[-1]}")
        out = _together(client, model, prompts[:n - 1], tokens, late=prompts[(r + 1) % n], reader=reader)
        v = out["late"]
        ttft_mid.append(v[3] - v[2])
        same.append(v[0] == alone_text[prompts[(r + 1) % n]])
        log(f"round {r}: a request sent while {n - 1} decode: time to first token {1e3 * ttft_mid[-1]:.0f} ms")
    return {"alone_tokens_per_s": alone, "together_tokens_per_s": together,
            "ratio": [t / a for t, a in zip(together, alone)], "ttft_idle_s": ttft_idle, "ttft_mid_batch_s": ttft_mid,
            "ttft_ratio": [m / i for m, i in zip(ttft_mid, ttft_idle)], "texts_as_alone": all(same),
            "client_reader": reader}
