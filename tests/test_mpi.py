"""Runs under mpiexec: Communicator.from_mpi against MPI's own Allreduce, and a smoke run of
bench/allreduce.py (skipped while the benchmark does not exist)."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "allreduce.py")
MPI_TIMEOUT_S = 150


def find_mpiexec():
    """mpiexec next to the interpreter (the mpich wheel installs it there), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec")


MPIEXEC = find_mpiexec()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")


def mpirun(n, args, timeout=MPI_TIMEOUT_S, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCCL_")}
    env["KCCL_TIMEOUT_MS"] = "30000"  # a broken rendezvous fails instead of hanging
    try:
        return subprocess.run([MPIEXEC, "-n", str(n)] + args, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpiexec -n {n} {' '.join(args)} ran past {timeout} s:\n{e.stdout}\n{e.stderr}")


FROM_MPI = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    import kccl

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    comm = kccl.Communicator.from_mpi(world, config={"timeout_ms": 30000})
    assert (comm.rank, comm.size) == (rank, n), (comm.rank, comm.size)
    problems = []
    ops = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MAX": MPI.MAX, "MIN": MPI.MIN}
    for dtype in (np.int8, np.int32, np.uint64, np.float32, np.float64):
        for name, mop in ops.items():
            for count in (0, 1, 1000, 300_001):
                rng = np.random.default_rng([count, rank])
                if np.dtype(dtype).kind == "f":  # small integers: exact whatever MPI's order
                    x = rng.integers(-3, 4, count).astype(dtype)
                else:
                    x = rng.integers(0, 100, count).astype(dtype)
                mine, theirs = np.empty_like(x), np.empty_like(x)
                comm.all_reduce(x, mine, op=getattr(kccl, name))
                world.Allreduce(x, theirs, op=mop)
                if mine.tobytes() != theirs.tobytes():
                    problems.append(f"{np.dtype(dtype).name} {name} count={count}")
    # the KCCL communicator and MPI agree on who is who
    g = comm.all_gather(np.array([rank], np.int64))
    if g.ravel().tolist() != list(range(n)):
        problems.append(f"all_gather of ranks: {g.ravel().tolist()}")
    comm.close()
    allp = world.gather(problems, root=0)
    if rank == 0:
        flat = [f"rank {r}: {p}" for r, ps in enumerate(allp) for p in ps]
        print("PROBLEMS" if flat else "ALL OK", *flat, sep="\\n")
        sys.exit(1 if flat else 0)
""")


@needs_mpi
def test_from_mpi_matches_mpi_allreduce(tmp_path):
    script = tmp_path / "from_mpi.py"
    script.write_text(FROM_MPI)
    p = mpirun(3, [sys.executable, str(script)])
    assert p.returncode == 0 and "ALL OK" in p.stdout, f"rc={p.returncode}\n{p.stdout}\n{p.stderr}"


def _bench_args(help_text, json_path):
    """Tiny-size, few-iteration arguments, using only flags that --help lists."""
    wanted = [(("-b", "--minbytes"), "4"), (("-e", "--maxbytes"), "4K"), (("-f", "--stepfactor"), "8"),
              (("-w", "--warmup"), "2"), (("-n", "--iters"), "5"), (("-r", "--rounds"), "1"),
              (("--round-ms",), "5"), (("--json",), json_path)]
    args = []
    for names, value in wanted:
        for name in names:
            if re.search(rf"(^|[\s\[,]){re.escape(name)}\b", help_text):
                args += [name, value]
                break
    return args


@needs_mpi
@pytest.mark.skipif(not os.path.exists(BENCH), reason="bench/allreduce.py does not exist yet")
def test_bench_allreduce_smoke(tmp_path):
    h = subprocess.run([sys.executable, BENCH, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert h.returncode == 0, h.stderr
    out_json = str(tmp_path / "bench.json")
    args = _bench_args(h.stdout, out_json)
    p = mpirun(2, [sys.executable, BENCH] + args)
    assert p.returncode == 0, f"args {args}\n{p.stdout}\n{p.stderr}"
    assert p.stdout.strip(), "the benchmark printed nothing"
    assert "FAILED" not in p.stdout, p.stdout
    if "--json" in args:
        with open(out_json) as f:
            data = json.load(f)
        rows = data.get("rows", data) if isinstance(data, dict) else data
        assert rows, data
        for row in rows:  # any "wrong" count must be 0
            for k, v in row.items():
                if "wrong" in k and v is not None:
                    assert v == 0, row
