"""Helpers the benchmark scripts share, in one place: sizes on the command line and in
tables, a CUDA device per MPI rank and graph capture (PyTorch, imported only when
asked for), the statistics of paired rounds, and writing a result file.

A script in bench/ imports it directly (its own directory is on sys.path); one in a
subdirectory, or one loaded by path, puts bench/ on sys.path first.  The native
benchmarks (the C timing loops) are kccl_bench.py's."""
import json
import os
import sys
from math import comb

import numpy as np

# -- launching under MPI, with and without libkccl_nccl.so -----------------------------------


def mpi_launcher(nranks):
    """The command that starts nranks processes: $MPIEXEC (default mpiexec) -n nranks."""
    import os
    import shlex
    return shlex.split(os.environ.get("MPIEXEC", "mpiexec")) + ["-n", str(nranks)]


def nccl_shim_runs():
    """[(name, command prefix)]: plain NCCL, then the shim preloaded with KCCL_DEBUG=INFO (whose
    line per communicator at close says how many all-reduces went to KCCL).  `env` is the
    launched program, so the preload reaches the ranks with any MPI launcher."""
    from kccl.paths import NCCL_SHIM
    return [("nccl", []), ("kccl_nccl", ["env", f"LD_PRELOAD={NCCL_SHIM}", "KCCL_DEBUG=INFO"])]


def launch_local_ranks(script, world, args):
    """Runs `script` as `world` processes on this machine with torch's env:// variables set
    (MASTER_ADDR / MASTER_PORT on a free port, RANK, WORLD_SIZE; OMP_NUM_THREADS=1) and
    `args` after it; passes rank 0's output through and returns the JSON of its last
    "RESULT " line.  Exits naming the code when a rank fails."""
    import json
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(script)] + list(args), env=env,
                                      stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True))
    result = None
    for line in procs[0].stdout:
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
        else:
            print(line, end="", flush=True)
    for p in procs:
        if p.wait():
            raise SystemExit(f"a rank exited with {p.returncode}")
    return result


# -- sizes ------------------------------------------------------------------------------------


def parse_size(text):
    """'64', '8K', '1.5M', '2GB' -> bytes (K, M, G are powers of 1024)."""
    s = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def fmt_size(n):
    """Bytes in the largest unit that divides them: 4096 -> '4K', 100 -> '100'."""
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


# -- CUDA through PyTorch ------------------------------------------------------------------------


def cuda_rank_device(world, what):
    """(torch, this rank's device, devices visible), the device selected (rank % devices),
    or None after rank 0 says what is missing."""
    try:
        import torch
    except ImportError:
        if world.Get_rank() == 0:
            print(f"error: {what} needs PyTorch with CUDA (its tensors, streams and graphs)", file=sys.stderr)
        return None
    ndev = torch.cuda.device_count()
    if ndev == 0:
        if world.Get_rank() == 0:
            print(f"error: {what}: no CUDA device visible", file=sys.stderr)
        return None
    dev = world.Get_rank() % ndev
    torch.cuda.set_device(dev)
    return torch, dev, ndev


def capture_graph(fn, warmup=None):
    """fn captured in a CUDA graph, after running warmup() and fn once eagerly on a side
    stream (as torch recommends)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        if warmup is not None:
            warmup()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


# -- paired rounds ----------------------------------------------------------------------------


def median_ci(ratios, n_boot=10000, seed=0):
    """Median of paired per-round ratios and its bootstrap 95 % interval (resampling rounds)."""
    r = np.asarray(ratios, dtype=float)
    rng = np.random.default_rng(seed)
    boot = [np.median(rng.choice(r, len(r))) for _ in range(n_boot)]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(np.median(r)), float(lo), float(hi)


def sign_test_p(k, n):
    """One-sided sign test: P(at least k of n rounds favour one side) when neither is better."""
    return sum(comb(n, i) for i in range(k, n + 1)) / 2 ** n


def write_json(path, obj):
    """Writes obj as indented JSON to path, making its folder first."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
