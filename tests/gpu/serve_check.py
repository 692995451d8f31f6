"""KIE's command line and server on the GPU, end to end (run on a GPU machine):

    python tests/gpu/serve_check.py [--config 2b]

On checkpoints made here with `kie_engine init`:
  generate   `python -m kie_engine generate --device cuda` on the --config checkpoint: exit 0,
             the tokens asked for, a tokens/s line; and with two lanes under mpiexec (a GPU each,
             or both on GPU 0 under MPS when the caller started it)
  serve      `serve --device cuda`: a streamed completion (SSE chunks, then [DONE]; an init
             checkpoint has no chat template), a plain completion, /metrics, then SIGTERM: exit 0
  nan        a checkpoint whose final norm is 3e38 (finite, but the logits overflow): the
             request gets a clean JSON error naming non-finite logits, and the server still
             answers after it
  dead lane  two lanes serving; lane 1 is SIGKILLed while a request streams: the stream ends,
             the server exits with an error line (no hang), nothing of KCCL is left in /dev/shm
Prints one PASS/FAIL line per check and `KIE GPU SERVE: n passed, m failed`; exit 1 on any failure."""
import argparse
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the server tests' helpers

from _serve import OpenStream, ServerProcess, mpiexec, parse_sse, post, request  # noqa: E402

RESULTS = []


def record(name, ok, why=""):
    RESULTS.append(ok)
    print(("PASS " if ok else "FAIL ") + name + (f": {why}" if why else ""), flush=True)


def env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")


def init(config, out):
    subprocess.run([sys.executable, "-m", "kie_engine", "init", "--config", config, "--out", out], check=True,
                   env=env(), stdout=subprocess.DEVNULL)


def set_tensor(ckpt, name, value):
    """Every element of bf16 tensor `name` in ckpt's model.safetensors set to `value`."""
    path = os.path.join(ckpt, "model.safetensors")
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n))[name]
        assert meta["dtype"] == "BF16", meta
        a, b = meta["data_offsets"]
        bits = struct.unpack("<I", struct.pack("<f", value))[0] >> 16
        f.seek(8 + n + a)
        f.write(struct.pack("<H", bits) * ((b - a) // 2))


def check_generate(ckpt, lanes):
    cmd = [sys.executable, "-m", "kie_engine", "generate", "--model", ckpt, "--device", "cuda", "--prompt", "hello",
           "--max-new-tokens", "32", "--ignore-eos"]
    if lanes > 1:
        cmd = [mpiexec(), "--oversubscribe", "--allow-run-as-root", "-n", str(lanes)] + cmd
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    out = (p.stdout + p.stderr).strip().splitlines()
    record(f"generate --device cuda, {lanes} lane(s)", p.returncode == 0 and any("tokens/s" in l for l in out),
           f"exit {p.returncode} in {time.monotonic() - t0:.0f} s; last: {out[-1][:160] if out else ''}")


def check_serve(ckpt):
    s = ServerProcess("--device", "cuda", model=ckpt)
    try:
        # an init checkpoint has no chat template (chat requests get 400 no_chat_template): completions
        body = {"model": s.name, "prompt": "hello", "max_tokens": 24, "stream": True, "temperature": 0,
                "ignore_eos": True}
        st, _, text = post(s, "/v1/completions", body)
        ev = parse_sse(text) if isinstance(text, str) else []
        chunks = [e for e in ev if isinstance(e, dict)]
        ok = st == 200 and ev and ev[-1] == "[DONE]" and chunks and all(e.get("object") == "text_completion"
                                                                         for e in chunks)
        record("serve --device cuda: streamed completion", bool(ok), f"status {st}, {len(chunks)} chunks")
        st, _, js = post(s, "/v1/completions", {"model": s.name, "prompt": "abc", "max_tokens": 8, "temperature": 0})
        record("serve --device cuda: completion", st == 200 and js["usage"]["completion_tokens"] == 8,
               f"status {st}: {str(js)[:160]}")
        st, _, m = request(s, "GET", "/metrics")
        record("serve --device cuda: /metrics", st == 200 and "kie_" in m, f"status {st}")
        rc, secs = s.terminate()
        record("serve --device cuda: SIGTERM ends it", rc == 0, f"exit {rc} after {secs:.1f} s")
    finally:
        s.kill()


def check_nan(root):
    ckpt = os.path.join(root, "tiny_overflow")
    init("tiny", ckpt)
    set_tensor(ckpt, "model.norm.weight", 3e38)
    s = ServerProcess("--device", "cuda", model=ckpt)
    try:
        body = {"model": s.name, "prompt": "abc", "max_tokens": 4, "temperature": 0}
        st, _, js = post(s, "/v1/completions", body)
        msg = json.dumps(js)
        record("serve: non-finite logits get a clean error", st >= 400 and "finite" in msg, f"status {st}: {msg[:200]}")
        st2, _, js2 = post(s, "/v1/completions", body)
        record("serve: and it still answers after", st2 == st, f"status {st2}")
    finally:
        s.kill()


def check_dead_lane(ckpt):
    s = ServerProcess("--device", "cuda", n=2, model=ckpt)
    try:
        def rank_of(pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    envs = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                return None
            for k in (b"OMPI_COMM_WORLD_RANK", b"PMIX_RANK", b"PMI_RANK"):
                if k in envs:
                    return int(envs[k])
            return None
        lanes = {rank_of(p): p for p in s.processes() if p != s.proc.pid}
        body = {"model": s.name, "prompt": "abc", "max_tokens": 4000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        stream = OpenStream(s, "/v1/completions", body)
        first = stream.next_event()
        if 1 not in lanes:
            record("serve, two lanes: a dead lane ends the stream and the server cleanly", False,
                   f"lane 1 not found among {lanes}")
            return
        os.kill(lanes[1], signal.SIGKILL)
        t0 = time.monotonic()
        rest = stream.rest()
        took = time.monotonic() - t0
        try:
            rc = s.proc.wait(60)
        except subprocess.TimeoutExpired:
            rc = None
        left = [n for n in os.listdir("/dev/shm") if n.startswith("kccl-")]
        ok = first is not None and took < 30 and rc not in (None, 0) and not left
        record("serve, two lanes: a dead lane ends the stream and the server cleanly", ok,
               f"stream ended {took:.1f} s after the kill with {len(rest)} more events; server exit {rc}; "
               f"/dev/shm leftovers {left}; last lines: {s.output().strip().splitlines()[-2:]}")
    finally:
        s.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="2b")
    ap.add_argument("--skip", default="", help="comma-separated checks to skip: generate,serve,nan,dead")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    with tempfile.TemporaryDirectory() as root:
        ckpt = os.path.join(root, a.config)
        init(a.config, ckpt)
        for name, fn in (("generate", lambda: (check_generate(ckpt, 1), check_generate(ckpt, 2))),
                         ("serve", lambda: check_serve(ckpt)), ("nan", lambda: check_nan(root)),
                         ("dead", lambda: check_dead_lane(ckpt))):
            if name in skip:
                continue
            try:
                fn()
            except Exception as e:
                record(f"{name} crashed", False, f"{type(e).__name__}: {e}")
    print(f"KIE GPU SERVE: {sum(RESULTS)} passed, {len(RESULTS) - sum(RESULTS)} failed", flush=True)
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
