"""Helpers of the server tests: a `python -m kie_engine serve` process (under mpiexec for
TP > 1) with its URL, raw HTTP over http.client, SSE parsing and Prometheus text parsing."""
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from urllib.parse import urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT = 240  # loading SmolLM2 takes seconds; the machine may be shared


def mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


class ServerProcess:
    """`serve --model smollm2 --port 0 ...` in a new session; .url once it listens.  A unique
    --served-model-name tags its processes (lanes included) for the leftover check."""

    def __init__(self, *args, n=1, model="smollm2", name=None):
        self.name = name or f"smollm2-{uuid.uuid4().hex[:8]}"
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "kie_engine", "serve", "--model", model, "--port", "0", "--blas-threads", "1",
               "--served-model-name", self.name, *args]
        if n > 1:
            cmd = [mpiexec(), "-n", str(n)] + cmd
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines = []
        self._ready = threading.Event()
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(START_TIMEOUT) or self.url is None:
            self.kill()
            raise RuntimeError(f"the server did not start:\n{self.output()}")

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"KIE serving .* at (http://\S+)", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def output(self):
        return "".join(self.lines)

    @property
    def host_port(self):
        u = urlparse(self.url)
        return u.hostname, u.port

    def conn(self, timeout=300):
        return http.client.HTTPConnection(*self.host_port, timeout=timeout)

    def terminate(self, timeout=30):
        """SIGTERM (to mpiexec, which passes it to every rank); the exit status and seconds taken."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return rc, time.monotonic() - t0

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)

    def processes(self):
        """Pids of live processes whose command line names this server (the lanes too)."""
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if self.name.encode() in cmd:
                out.append(int(pid))
        return out


def request(server, method, path, body=None, raw=None, headers=None, timeout=300):
    """(status, headers, parsed JSON or text) of one request."""
    c = server.conn(timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        c.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        text = r.read().decode("utf-8")
        ctype = r.getheader("Content-Type", "")
        return r.status, r, (json.loads(text) if "json" in ctype else text)
    finally:
        c.close()


def post(server, path, body, **kw):
    return request(server, "POST", path, body, **kw)


def parse_sse(text):
    """The data payloads of an event stream, [DONE] as the string "[DONE]"."""
    out = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                payload = line[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


class OpenStream:
    """A streaming POST read event by event over a raw socket (so a test can hang up)."""

    def __init__(self, server, path, body):
        self.c = server.conn()
        self.c.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        self.r = self.c.getresponse()
        self.buf = b""

    def next_event(self):
        while b"\n\n" not in self.buf:
            chunk = self.r.read1(65536)  # de-chunked, as it comes
            if not chunk:
                return None
            self.buf += chunk
        block, self.buf = self.buf.split(b"\n\n", 1)
        payload = block.decode()[len("data: "):]
        return payload if payload == "[DONE]" else json.loads(payload)

    def rest(self):
        out = []
        while True:
            ev = self.next_event()
            if ev is None:
                return out
            out.append(ev)

    def close(self):
        self.c.sock.close() if self.c.sock else None
        self.c.close()


def parse_metrics(text):
    """{(name, frozenset(labels.items())): value}; asserts the exposition format's rules
    that the tests rely on (TYPE before samples, one sample per line)."""
    samples, types = {}, {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)', line)
        assert m, f"not a sample line: {line!r}"
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        base = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        assert m.group(1) in types or base in types, f"sample before its TYPE: {line!r}"
        samples[(m.group(1), frozenset(labels.items()))] = float(m.group(3))
    return samples, types


def server_metrics(server):
    """The samples of the server's /metrics now."""
    return parse_metrics(request(server, "GET", "/metrics")[2])[0]


def wait_until(pred, timeout=120):
    t = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < t, "timed out"
        time.sleep(0.05)


def metric(samples, name, **labels):
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))
