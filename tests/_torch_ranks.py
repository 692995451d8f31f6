"""Launching torch.distributed ranks for the kccl.torch tests: `launch` starts one
process per rank running a scenario of tests/_torch_scenarios.py (which prints its
result as the last "RESULT <json>" line), with the init method asked for, and
returns what every rank said.  A rank that runs past the bound is killed and
reported, so a hang fails the test instead of stalling it."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "_torch_scenarios.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankResult:
    def __init__(self, rank, rc, out, err, elapsed):
        self.rank, self.rc, self.stdout, self.stderr, self.elapsed = rank, rc, out, err, elapsed
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        self.result = json.loads(lines[-1][7:]) if lines else None

    def __repr__(self):
        return f"<rank {self.rank} rc={self.rc} result={self.result!r} stderr={self.stderr[-2000:]!r}>"


def launch(scenario, world, *, init="tcp", args=None, env=None, timeout=120.0):
    """[RankResult per rank].  init: "tcp", "file", "env" (MASTER_ADDR/PORT, RANK,
    WORLD_SIZE), or "pmi" (MASTER_ADDR/PORT and PMI_RANK/PMI_SIZE, as mpiexec sets)."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="kccl-torch-test-")
    method = {"tcp": f"tcp://127.0.0.1:{port}", "file": f"file://{tmp}/rendezvous", "env": "env://",
              "pmi": "env://"}[init]
    procs = []
    for r in range(world):
        e = dict(os.environ, **(env or {}))
        e["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), e.get("PYTHONPATH", "")])
        if init in ("env", "pmi"):
            e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            if init == "env":
                e.update(RANK=str(r), WORLD_SIZE=str(world))
            else:
                e.update(PMI_RANK=str(r), PMI_SIZE=str(world))
        cmd = [sys.executable, SCENARIOS, scenario, str(r), str(world), method, json.dumps(args or {})]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e))
    t0 = time.monotonic()
    out = []
    for r, p in enumerate(procs):
        try:
            o, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            o, err = p.communicate()
            err += f"\n[killed after {timeout} s]"
        out.append(RankResult(r, p.returncode, o, err, time.monotonic() - t0))
    return out


def launch_mpiexec(scenario, world, *, args=None, env=None, timeout=120.0):
    """[result of every rank] of a scenario started by `mpiexec -n world` with MASTER_ADDR and
    MASTER_PORT set (the ranks find RANK / WORLD_SIZE in PMI_RANK / PMI_SIZE), or None
    when there is no mpiexec."""
    import shutil
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        return None
    e = dict(os.environ, **(env or {}))
    e["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), e.get("PYTHONPATH", "")])
    e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        e.pop(k, None)
    cmd = [mpiexec, "-n", str(world), sys.executable, SCENARIOS, scenario, "-1", str(world), "env://",
           json.dumps(args or {})]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        err += f"\n[killed after {timeout} s]"
    return p.returncode, _results(out), err


def _results(out):
    """Every "RESULT <json>" in mpiexec's merged output: its forwarding may put the ranks'
    lines together without a newline between them, so each is decoded where it starts."""
    decoder, results, at = json.JSONDecoder(), [], out.find("RESULT ")
    while at >= 0:
        try:
            obj, end = decoder.raw_decode(out, at + len("RESULT "))
            results.append(obj)
        except ValueError:
            end = at + 1
        at = out.find("RESULT ", end)
    return results
