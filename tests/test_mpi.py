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


# -- the benchmark's output: files it wrote, what #wrong means, a plot that reads -----------------

@needs_mpi
def test_bench_allreduce_says_what_it_wrote(tmp_path):
    out_json, out_png = str(tmp_path / "b.json"), str(tmp_path / "b.png")
    p = mpirun(2, [sys.executable, BENCH, "-b", "4", "-e", "64K", "-f", "64", "-w", "2", "-n", "5", "-r", "1",
                   "--round-ms", "5", "--json", out_json, "--plot", out_png])
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert f"wrote {out_json}" in lines and f"wrote {out_png}" in lines, p.stdout
    assert os.path.getsize(out_png) > 0 and json.load(open(out_json))["rows"]
    assert any(ln.startswith("# #wrong") and "0/0 = all correct" in ln for ln in lines), p.stdout


PLOT_PROBE = textwrap.dedent("""
    import importlib.util, json, sys
    import mpi4py
    mpi4py.rc.initialize = False  # the plot needs no MPI
    spec = importlib.util.spec_from_file_location("bench_allreduce", sys.argv[1])
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    sizes = [4 << (2 * i) for i in range(12)]  # 4 B .. 16 MB
    rows = [dict(bytes=n, dtype="float32", op="sum", kccl_us_avg=1 + n / 1e4, c_us=0.5 + n / 1e4,
                 mpi_us_avg=3 + n / 5e3, ratio=(3 + n / 5e3) / (1 + n / 1e4)) for n in sizes]
    out = {}
    for algo in ("auto", "oneshot"):
        meta = dict(nranks=2, settings={"KCCL_ALGO": algo, "KCCL_ONESHOT_MAX_BYTES": 16384})
        fig = b.plot(rows, meta, sys.argv[2])
        fig.canvas.draw()
        ax, rax = fig.axes
        vlines = [[list(map(float, l.get_xdata())) for l in a.lines if len(set(l.get_xdata())) == 1
                   and len(l.get_xdata()) == 2] for a in (ax, rax)]
        out[algo] = dict(naxes=len(fig.axes), labels=[t.get_text() for t in rax.get_xticklabels()],
                         ratio=[float(y) for y in rax.lines[0].get_ydata()], vlines=vlines, title=ax.get_title())
    out["want_ratio"] = [r["ratio"] for r in rows]
    print(json.dumps(out))
""")


def test_bench_plot_has_size_labels_a_ratio_panel_and_the_crossover(tmp_path):
    pytest.importorskip("matplotlib")
    probe = tmp_path / "probe.py"
    probe.write_text(PLOT_PROBE)
    p = subprocess.run([sys.executable, str(probe), BENCH, str(tmp_path / "p.png")], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    auto, forced = d["auto"], d["oneshot"]
    assert auto["naxes"] == 2
    assert {"4 B", "64 B", "1 KB", "64 KB", "1 MB", "16 MB"} <= set(auto["labels"]), auto["labels"]
    assert not any("^" in lab or "e+" in lab for lab in auto["labels"]), auto["labels"]  # no powers of ten
    assert auto["ratio"] == pytest.approx(d["want_ratio"])
    cross = 16384 * 2 ** 0.5  # between the last one-shot size and the next
    assert all(any(v == pytest.approx([cross, cross]) for v in panel) for panel in auto["vlines"]), auto["vlines"]
    assert forced["vlines"] == [[], []] and "KCCL_ALGO=oneshot" in forced["title"]


def test_ratio_range_over_runs(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import ratio_range
    finally:
        sys.path.pop(0)
    paths = []
    for i, (k, m) in enumerate([(1.0, 3.0), (1.0, 2.0), (2.0, 5.0)]):
        doc = {"meta": {"nranks": 2}, "rows": [
            {"bytes": 4, "dtype": "float32", "op": "sum", "kccl_us_avg": k, "mpi_us_avg": m, "ratio": m / k},
            {"bytes": 8, "dtype": "float32", "op": "sum", "kccl_us_avg": k, "mpi_us_avg": None, "ratio": None}]}
        paths.append(str(tmp_path / f"r{i}.json"))
        json.dump(doc, open(paths[-1], "w"))
    (row,) = ratio_range.summarize(ratio_range.load(paths))
    assert (row["bytes"], row["runs"], row["ratio_min"], row["ratio_median"], row["ratio_max"]) == (4, 3, 2.0, 2.5, 3.0)
    assert (row["kccl_us"], row["mpi_us"]) == (1.0, 3.0)
    kept = str(tmp_path / "kept.json")  # the runs of one figure kept in one file, as bench/results holds them
    json.dump({"runs": [json.load(open(q)) for q in paths[1:]]}, open(kept, "w"))
    assert [r["runs"] for r in ratio_range.summarize(ratio_range.load([paths[0], kept]))] == [3]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ratio_range.py"), *paths], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and re.search(r"^\s+4\s+3\s+1\.00\s+3\.00 \|\s+2\.00\s+2\.50\s+3\.00$", p.stdout, re.M), p.stdout
    bad = str(tmp_path / "bad.json")
    json.dump({"meta": {"nranks": 4}, "rows": [{"bytes": 4, "dtype": "float32", "op": "sum"}]}, open(bad, "w"))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ratio_range.py"), paths[0], bad],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("error: runs differ"), p.stderr


# -- a rank dies under mpiexec: the survivors get KCCL's error, if the launcher lets them live -----

SURVIVOR = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from mpi4py import MPI
    import kccl

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    comm = kccl.Communicator.from_mpi(world, config={"timeout_ms": 20000})
    x = np.ones(256, np.float32)
    comm.all_reduce(x)
    comm.barrier()
    world.Barrier()
    sys.path.insert(0, TESTS_DIR)
    from _mpi_shm import forget_mpi_segments
    mpi_shm = forget_mpi_segments()  # no rank reaches MPI_Finalize: MPICH's segments would outlive the job
    if rank == n - 1:
        os._exit(1)  # gone without MPI_Finalize or comm.close(); not a signal (see the test's docstring)
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            comm.all_reduce(x)
        out = {"rank": rank, "error": None}
    except kccl.KcclError as e:
        out = {"rank": rank, "error": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0}
    out["mpi_shm"] = mpi_shm
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:  # Hydra may drop stdout of ranks
        json.dump(out, f)                                                  # that end without MPI_Finalize
    os._exit(0)  # MPI_Finalize would wait for the dead rank
""").replace("TESTS_DIR", repr(os.path.dirname(os.path.abspath(__file__))))


def _launcher_has(flag):
    h = subprocess.run([MPIEXEC, "-help"], capture_output=True, text=True, timeout=60)
    return flag in h.stdout + h.stderr


@needs_mpi
def test_survivors_report_the_dead_rank_under_disable_auto_cleanup(tmp_path):
    """MPICH's Hydra kills every rank as soon as one dies; with -disable-auto-cleanup (the
    docs/kccl.md's advice) the survivors live on, and KCCL tells each which rank died.

    The dead rank exits (os._exit, so neither MPI nor KCCL hears a goodbye) rather than being
    SIGKILLed: Hydra's proxy SIGKILLs all its other ranks when it reaps one that a signal
    killed, -disable-auto-cleanup or not, so with a signal the survivors would race the
    launcher to write their reports (tests/test_failures.py covers SIGKILLed peers)."""
    if not _launcher_has("-disable-auto-cleanup"):
        pytest.skip("this mpiexec has no -disable-auto-cleanup (not MPICH's Hydra)")
    script = tmp_path / "survivor.py"
    script.write_text(SURVIVOR)
    p = mpirun(3, ["-disable-auto-cleanup", sys.executable, str(script), str(tmp_path)])
    outs = [json.load(open(tmp_path / f)) for f in sorted(os.listdir(tmp_path)) if f.endswith(".json")]
    assert sorted(o["rank"] for o in outs) == [0, 1], p.stdout + p.stderr
    for o in outs:
        assert o["error"] == "KcclRemoteError", o
        assert "rank 2" in o["msg"] and "died" in o["msg"], o
        assert o["seconds"] < 5, o
    # MPICH's segments, named until an MPI_Finalize that no rank here reaches (tests/_mpi_shm.py)
    assert outs[0]["mpi_shm"] and not [n for o in outs for n in o["mpi_shm"] if os.path.exists(n)]


@needs_mpi
def test_misspelled_setting_is_warned_about_once_per_job(tmp_path):
    """Issue 33: one line per job where the launcher tells the ranks apart (Hydra sets
    PMI_RANK), not one per rank."""
    script = tmp_path / "job.py"
    script.write_text("import kccl\nfrom mpi4py import MPI\nkccl.Communicator.from_mpi(MPI.COMM_WORLD).close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCCL_")}
    env["KCCL_TIMOUT_MS"] = "500"
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=MPI_TIMEOUT_S)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if "KCCL_TIMOUT_MS" in ln]
    assert len(lines) == 1 and "did you mean KCCL_TIMEOUT_MS?" in lines[0], p.stderr
