"""Communicators over several hosts, simulated on one machine: KCCL_HOST_ID per rank
makes 4 ranks 2 hosts x 2 and 5 ranks 3 hosts (2 + 2 + 1), and MPICH is told the same
layout (MPIR_CVAR_NUM_CLIQUES, or MPIR_CVAR_NOLOCAL=1 for blocks set with mpiexec -env)
with UCX on TCP only, so that the inter-host leg takes MPI's network path, not its
shared memory.  Every collective and type is checked against MPI on the same inputs
(tests/hier_ranks.py runs on the ranks), then every failure."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402

pytest.importorskip("mpi4py")

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS_PY = os.path.join(HERE, "hier_ranks.py")
DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64"]
OPS = ["sum", "prod", "max", "min", "avg"]
LARGE = 4096  # KCCL_HIER_LARGE_BYTES in these runs: both all-reduce paths at modest counts


def find_mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


MPIEXEC = find_mpiexec()
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")


def mpi_segments_left(out):
    """The MPICH segments the ranks of a `kill` launch mapped (hier_ranks.py wrote their
    names to `out`) that are still in /dev/shm; the names' count must be > 0, or the check
    would prove nothing."""
    names = {n for f in out.glob("mpi_shm*.json") for n in json.loads(f.read_text())}
    assert names, "no rank saw MPICH's segments: the check below would prove nothing"
    return sorted(n for n in names if os.path.exists(n))


def kccl_segments():
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("kccl-")}
    except FileNotFoundError:
        return set()


def base_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KCCL_", "MPIR_CVAR_", "UCX_", "HIER_"))}
    env.update(KCCL_TIMEOUT_MS="20000", KCCL_HIER_LARGE_BYTES=str(LARGE), UCX_TLS="tcp", PYTHONFAULTHANDLER="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(nranks, hosts, args, *, timeout=120, cleanup=True, **extra):
    """Runs hier_ranks.py on nranks ranks as `hosts` hosts (rank % hosts, as MPICH's cliques)."""
    env = base_env(HIER_HOSTS=hosts, MPIR_CVAR_NUM_CLIQUES=hosts, **extra)
    cmd = [MPIEXEC] + ([] if cleanup else ["-disable-auto-cleanup"])
    cmd += ["-n", str(nranks), sys.executable, RANKS_PY] + [str(a) for a in args]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{e.stdout}\n{e.stderr}")


def results(p):
    got = [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert got, f"rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    return got


def fixed_cases():
    """Every type with every op on both all-reduce paths (blocking, in place, split phase),
    every other collective with every type, count 0, and a message over KCCL_BUFFER_BYTES."""
    cases = []
    for i, dtype in enumerate(DTYPES):
        for j, op in enumerate(OPS):
            seed = 100 * i + j
            cases += [dict(coll="all_reduce", dtype=dtype, op=op, count=37, seed=seed),
                      dict(coll="all_reduce", dtype=dtype, op=op, count=5003, seed=seed),
                      dict(coll="all_reduce_start", dtype=dtype, op=op, count=29, seed=seed),
                      dict(coll="reduce_scatter", dtype=dtype, op=op, count=7, seed=seed)]
        cases += [dict(coll="all_reduce_inplace", dtype=dtype, op="sum", count=3001, seed=i),
                  dict(coll="all_reduce_start", dtype=dtype, op="avg", count=3001, seed=i),
                  dict(coll="all_gather", dtype=dtype, op="sum", count=5, seed=i),
                  dict(coll="all_gather", dtype=dtype, op="sum", count=2001, seed=i),
                  dict(coll="broadcast", dtype=dtype, op="sum", count=9, root=i, seed=i),
                  dict(coll="broadcast", dtype=dtype, op="sum", count=4001, root=i + 1, seed=i)]
    for coll in ("all_reduce", "all_reduce_start", "reduce_scatter", "all_gather", "broadcast"):
        cases.append(dict(coll=coll, dtype="float32", op="sum", count=0, root=1, seed=0))
    cases += [dict(coll="barrier", dtype="float32", op="sum", count=0, seed=0),
              dict(coll="all_reduce", dtype="float32", op="sum", count=300_001, seed=7, values="normal"),
              dict(coll="all_reduce", dtype="float64", op="avg", count=1234, seed=8, values="normal")]
    for c in cases:
        c.setdefault("root", 0)
    return cases


def run_cases(tmp_path, nranks, hosts, cases, **kw):
    path = tmp_path / f"cases_{nranks}_{hosts}.json"
    path.write_text(json.dumps(cases))
    before = kccl_segments()
    p = kw.pop("runner", launch)(nranks, hosts, ["collectives", path], **kw)
    (every,) = results(p)
    assert p.returncode == 0, p.stderr
    problems = [pr for r in every for pr in r["problems"]]
    assert not problems, "\n".join(problems[:20])
    assert [r["type"] for r in every] == ["HierarchicalCommunicator"] * nranks
    assert all(r["hosts"] == hosts for r in every)
    assert kccl_segments() <= before, "KCCL segments left in /dev/shm"
    return every


@pytest.mark.parametrize("nranks,hosts", [(4, 2), (5, 3)], ids=["2x2", "2+2+1"])
def test_every_collective_and_type_matches_mpi(tmp_path, nranks, hosts):
    every = run_cases(tmp_path, nranks, hosts, fixed_cases())
    assert [r["host"] for r in every] == [r % hosts for r in range(nranks)]


_case = st.fixed_dictionaries({
    "coll": st.sampled_from(["all_reduce", "all_reduce_inplace", "all_reduce_start", "reduce_scatter",
                             "all_gather", "broadcast"]),
    "dtype": st.sampled_from(DTYPES), "op": st.sampled_from(OPS),
    "count": st.one_of(st.integers(0, 8), st.integers(0, 12000)),
    "root": st.integers(0, 4), "seed": st.integers(0, 2 ** 32 - 1),
    "values": st.sampled_from(["small", "normal"])})


def _plausible(case):
    if case["dtype"] not in ("float32", "float64"):
        case["values"] = "small"
    return case


# One mpiexec launch per example (seconds each): few examples of many cases each, and no
# shrinking (each step would be a launch); a failure prints its cases.
@settings(max_examples=2, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cases=st.lists(_case.map(_plausible), min_size=30, max_size=30), layout=st.sampled_from([(4, 2), (5, 3)]))
def test_random_cases_match_mpi(tmp_path, cases, layout):
    run_cases(tmp_path, layout[0], layout[1], cases)


def launch_mpmd(nranks, hosts, args, timeout=120):
    """Contiguous hosts set per block of ranks with mpiexec's MPMD -env, MPICH told every
    rank is its own node (MPIR_CVAR_NOLOCAL=1)."""
    env = base_env(MPIR_CVAR_NOLOCAL=1)
    cmd = [MPIEXEC]
    for i, n in enumerate((2, 2)):
        if i:
            cmd.append(":")
        cmd += ["-n", str(n), "-env", "KCCL_HOST_ID", f"block{i}", sys.executable, RANKS_PY] + [str(a) for a in args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_contiguous_hosts_from_mpiexec_env(tmp_path):
    cases = [c for c in fixed_cases() if c["dtype"] in ("bfloat16", "int32", "float64")]
    every = run_cases(tmp_path, 4, 2, cases, runner=launch_mpmd)
    assert [r["host"] for r in every] == [0, 0, 1, 1]


def test_mpi_sees_the_same_hosts_and_keeps_them_off_shared_memory():
    p = launch(4, 2, ["layout"], UCX_LOG_LEVEL="info")
    (every,) = results(p)
    for rank, r in enumerate(every):
        assert r["hosts"] == 2 and r["host"] == rank % 2
        assert r["mpi_node"] == [q for q in range(4) if q % 2 == rank % 2], "MPICH ignored MPIR_CVAR_NUM_CLIQUES"
    lanes = [ln for ln in p.stdout.splitlines() + p.stderr.splitlines() if "intra-node cfg" in ln]
    if not lanes:
        pytest.skip("MPICH does not run over UCX here: the transport check is UCX's")
    for ln in lanes:  # between our simulated hosts UCX may use TCP only (no sysv/posix/cma)
        assert "tcp/" in ln and not any(t in ln for t in ("sysv/", "posix/", "cma/", "xpmem/")), ln


def test_one_host_is_the_flat_communicator():
    (every,) = results(launch(2, 1, ["layout"]))
    assert all(r["hosts"] == 1 and r["host"] == 0 for r in every)


def test_unique_id_from_another_machine_is_refused_at_once():
    """The unique id carries its maker's machine key (boot id, /dev/shm, pid namespace); a
    rank elsewhere is refused at init instead of waiting KCCL_INIT_TIMEOUT_MS for segments it
    cannot see.  Here the key is forged (with a valid checksum) to stand for that rank."""
    import kccl

    def fnv(data, h=0xCBF29CE484222325):
        for byte in data:
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        return h
    uid = bytearray(kccl.get_unique_id())
    uid[48:56] = (int.from_bytes(uid[48:56], "little") ^ 0x5A5A).to_bytes(8, "little")
    uid[40:48] = fnv(uid[48:56], fnv(uid[:40])).to_bytes(8, "little")
    t0 = time.monotonic()
    with pytest.raises(kccl.KcclInvalidUsage, match="made on another machine"):
        kccl.Communicator(2, bytes(uid), 1, config={"timeout_ms": 20000})
    assert time.monotonic() - t0 < 5


# -- failures -----------------------------------------------------------------------------------
def _kill(tmp_path, nranks, hosts, victim, mpi_may_crash=False, **extra):
    """Survivors' reports, by rank.  mpi_may_crash: a survivor may instead be killed inside
    MPI (MPICH over UCX without fault tolerance can segfault in a call that reaches the
    dead rank; Hydra then kills the rest of the job), which stderr must show."""
    before = kccl_segments()
    t0 = time.monotonic()
    p = launch(nranks, hosts, ["kill", victim], cleanup=False, timeout=90, HIER_OUT=tmp_path, **extra)
    elapsed = time.monotonic() - t0
    got = {}
    for f in tmp_path.glob("rank*.json"):
        r = json.loads(f.read_text())
        got[r["rank"]] = r
    missing = [r for r in range(nranks) if r != victim and r not in got]
    crashed = "Fatal Python error: Segmentation fault" in p.stderr
    assert not missing or (mpi_may_crash and crashed), f"no report from {missing}\n{p.stdout}\n{p.stderr}"
    for r in got.values():
        assert r["shm"] == [], r
        assert r["after"][0] == "KcclInvalidUsage", r  # broken for good
    assert kccl_segments() <= before
    assert mpi_segments_left(tmp_path) == []
    return got, elapsed


def _kill_until_reported(tmp_path, *args, **kw):
    """_kill, launched again (5 times at most: a second each) while MPI crashed before any
    survivor reported."""
    for attempt in range(5):
        out = tmp_path / f"try{attempt}"
        out.mkdir()
        got, elapsed = _kill(out, *args, mpi_may_crash=True, **kw)
        if got:
            return got, elapsed
    pytest.fail("every launch ended in MPI's crash before a survivor reported")


@pytest.mark.parametrize("victim", [3, 1], ids=["non-leader", "leader"])
def test_rank_dying_on_another_host_raises_everywhere(tmp_path, victim):
    if victim == 3:  # host 1's leader survives: no MPI call reaches the dead rank
        got, _ = _kill(tmp_path, 4, 2, victim)
    else:  # host 0's leader's next MPI call goes to the dead leader and may crash in MPI
        got, _ = _kill_until_reported(tmp_path, 4, 2, victim)
    for rank, r in got.items():
        cls, text, seconds = r["first"]
        assert cls == "KcclRemoteError", r
        dead = [victim] + [q for q in range(4) if q != victim and q not in got]  # + any that MPI killed
        assert any(f"rank {d} " in text for d in dead) and "died" in text, r
        assert seconds < 10, r  # KCCL_TIMEOUT_MS is 20 s: this is the notice, not a timeout


@pytest.mark.parametrize("count", [100, 20000], ids=["small", "large"])
def test_lone_host_gone_silent_times_out_everywhere(tmp_path, count):
    # host 2 is rank 2 alone: no KCCL peer can see it go and MPI does not say, so the bound
    # holds.  The rank stops answering rather than exiting (it exits once the others reported):
    # for the others the same loss, without MPI's crash on a dead peer ending the run first.
    got, _ = _kill(tmp_path, 5, 3, 2, KCCL_TIMEOUT_MS=2000, HIER_COUNT=count, HIER_VICTIM="silent")
    for rank, r in got.items():
        cls, text, seconds = r["first"]
        # a leader's MPI wait times out; a peer of its host either times out in KCCL itself or,
        # when its leader closed first, sees that leader abort (a timeout sends no notice: see
        # kccl/hierarchical.py's _fail)
        leader = rank % 3  # hosts are rank % 3, so a host's leader is its host number
        assert cls == "KcclTimeout" or (rank != leader and cls == "KcclRemoteError"
                                        and f"rank {leader} " in text and "aborted" in text), r
        assert 1.5 < seconds < 15, r


def test_default_mpiexec_ends_the_job_when_a_rank_dies(tmp_path):
    before = kccl_segments()
    t0 = time.monotonic()
    p = launch(4, 2, ["kill", 3], timeout=60, HIER_OUT=tmp_path)
    assert p.returncode != 0
    assert time.monotonic() - t0 < 30
    assert kccl_segments() <= before
    assert mpi_segments_left(tmp_path) == []  # the launcher SIGKILLed the survivors


def test_mismatches_mpi_errors_abort_and_settings():
    before = kccl_segments()
    (every,) = results(launch(4, 2, ["failures"]))
    for rank, seen in enumerate(every):
        for name in ("count", "op", "kind", "dtype", "large_count", "hot_op", "hot_kind"):
            (cls, text, _), after = seen[name]
            assert cls == "KcclRemoteError" and "collective mismatch across hosts" in text, (rank, name, seen[name])
            assert after[0] == "KcclInvalidUsage", (rank, name, after)
        (cls, text, _), _after = seen["mpi_error"]
        assert cls == "KcclRemoteError" and "MPI error between hosts" in text, (rank, seen["mpi_error"])
        if rank != 3:
            (cls, text, _), _after = seen["abort"]
            assert cls == "KcclRemoteError" and "rank 3" in text and "aborted" in text, (rank, seen["abort"])
        (cls, text, _), = seen["settings"]
        assert cls == "KcclInvalidArgument" and "KCCL_HIER_LARGE_BYTES" in text, (rank, seen["settings"])
        assert seen["shm"] == []
    assert kccl_segments() <= before
