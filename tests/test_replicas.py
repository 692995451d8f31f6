"""The host transport's per-domain replicas, exercised on this one-L3 machine through
topology files that describe its CPUs as separate L3 domains: the writer writes every
replica, each reader polls its own domain's, results stay exact, and mismatch / dead-peer
detection still work.  (Real processes; no test leaves a /dev/shm name behind.)"""
import os

import numpy as np
import pytest

import kccl
from _harness import WorkerTaskError
from topology.fixtures.fake import fake_l3s

TIMEOUT = {"timeout_ms": 10000}


def join(farm, n, config, per_rank_config=None):
    uid = bytes(kccl.get_unique_id())
    per = [{"rank": r, "config": dict(config, **(per_rank_config[r] if per_rank_config else {}))} for r in range(n)]
    return farm.run("topo_join", range(n), per_worker=per, uid=uid, nranks=n)


def release(farm, n):
    farm.run("release", range(n), name="topo")


@pytest.fixture
def two_domains_4ranks(tmp_path):
    return fake_l3s(tmp_path / "two.json", rank_domains=[0, 0, 1, 1])


def test_two_domains_writer_writes_both_reader_polls_its_own(spawn_farm, two_domains_4ranks):
    farm = spawn_farm(4)
    infos = join(farm, 4, dict(TIMEOUT, topo_file=two_domains_4ranks))
    for r, info in enumerate(infos):
        assert (info["ndomains"], info["domain"], info["replicas"]) == (2, r // 2, 1), (r, info)
        assert info["bound"] == 1, info  # bound to node 0 and verified with move_pages
    iters = 50
    res = farm.run("topo_loop", range(4), per_worker=[{"rank": r} for r in range(4)], nranks=4, iters=iters, count=16)
    for r, (ok, before, after) in enumerate(res):
        assert ok, f"rank {r}: wrong sum"
        # one remote domain: one push per publish; two peers in the other domain: two replica polls
        assert after["pushes"] - before["pushes"] == iters, (r, before, after)
        assert after["replica_reads"] - before["replica_reads"] == 2 * iters, (r, before, after)
    release(farm, 4)


def test_large_payloads_travel_without_replicas(spawn_farm, two_domains_4ranks):
    """Above 16 KB per slot neither flag nor data is replicated (one-shot and two-shot alike)."""
    farm = spawn_farm(4)
    for algo in ("oneshot", "twoshot"):
        join(farm, 4, dict(TIMEOUT, topo_file=two_domains_4ranks, algo=algo))
        res = farm.run("topo_loop", range(4), per_worker=[{"rank": r} for r in range(4)], nranks=4, iters=3,
                       count=300_000)  # 1.2 MB: two chunks of the 1 MB slot
        for r, (ok, before, after) in enumerate(res):
            assert ok, f"rank {r} ({algo}): wrong sum"
            assert (after["pushes"], after["replica_reads"]) == (before["pushes"], before["replica_reads"]), after
        release(farm, 4)


def test_every_collective_is_exact_through_replicas(spawn_farm, tmp_path):
    farm = spawn_farm(3)
    path = fake_l3s(tmp_path / "three.json", domains_of_cpu=(0, 1, 2), rank_domains=[2, 0, 1])
    for algo in ("auto", "twoshot"):
        infos = join(farm, 3, dict(TIMEOUT, topo_file=path, algo=algo, buffer_bytes=8192))
        assert all(i["replicas"] == 2 for i in infos), infos
        res = farm.run("topo_check", range(3), per_worker=[{"rank": r} for r in range(3)], nranks=3, seed=11)
        for r, (why, before, after) in enumerate(res):
            assert why is None, why
            assert after["pushes"] > before["pushes"] and after["replica_reads"] > before["replica_reads"], after
        release(farm, 3)


def test_topo_off_means_one_copy(spawn_farm, two_domains_4ranks):
    farm = spawn_farm(4)
    infos = join(farm, 4, dict(TIMEOUT, topo_file=two_domains_4ranks, topo="off"))
    assert all((i["ndomains"], i["replicas"], i["plan"]) == (1, 0, "KCCL_TOPO=off") for i in infos), infos
    res = farm.run("topo_loop", range(4), per_worker=[{"rank": r} for r in range(4)], nranks=4, iters=20, count=16)
    assert all(ok and after["pushes"] == 0 and after["replica_reads"] == 0 for ok, _b, after in res), res
    release(farm, 4)


def test_domains_follow_cpu_affinity(spawn_farm, tmp_path):
    """No rank_domains: a rank pinned to CPU c is in c's domain; an unpinned rank (both CPUs)
    spans the two and reads writers' own copies, while its peers push to both domains."""
    path = fake_l3s(tmp_path / "aff.json")
    farm = spawn_farm(3)
    farm.run("pin", [0], cpus=[0])
    farm.run("pin", [1], cpus=[1])
    infos = join(farm, 3, dict(TIMEOUT, topo_file=path))
    assert [i["domain"] for i in infos] == [0, 1, -1], infos
    assert [i["replicas"] for i in infos] == [1, 1, 2], infos
    res = farm.run("topo_check", range(3), per_worker=[{"rank": r, "counts": (1, 300)} for r in range(3)],
                   nranks=3, seed=5)
    for r, (why, _b, after) in enumerate(res):
        assert why is None, why
        assert (after["replica_reads"] > 0) == (r != 2), (r, after)  # the unpinned rank polls own copies only
    release(farm, 3)


def test_binding_failure_is_reported_not_fatal(spawn_farm, tmp_path):
    """Domain 1 on NUMA node 1000, which no machine here has: mbind fails, the replicas work anyway."""
    path = fake_l3s(tmp_path / "node1000.json", numa_of_domain=[0, 1000], rank_domains=[1, 0])
    farm = spawn_farm(2)
    infos = join(farm, 2, dict(TIMEOUT, topo_file=path))
    # rank 1 (domain 0) binds its replica for domain 1 to node 1000 and fails; rank 0 binds for node 0
    assert infos[1]["bound"] == -1 and "mbind" in infos[1]["note"] and "node 1000" in infos[1]["note"], infos[1]
    assert infos[0]["bound"] == 1, infos[0]
    res = farm.run("topo_loop", range(2), per_worker=[{"rank": r} for r in range(2)], nranks=2, iters=10, count=64)
    assert all(ok for ok, _b, _a in res), res
    release(farm, 2)


def test_mismatch_detected_with_replicas(spawn_farm, two_domains_4ranks):
    farm = spawn_farm(4)
    uid = bytes(kccl.get_unique_id())
    res = farm.run("mismatch", range(4), per_worker=[{"rank": r} for r in range(4)], uid=uid, nranks=4,
                   kind="count", odd_rank=3, config={"topo_file": two_domains_4ranks})
    for r, out in enumerate(res):
        assert out["type"] == "KcclRemoteError" and "mismatch" in out["msg"], (r, out)
        assert out["unchanged"], f"rank {r} wrote recv despite the mismatch"


def test_dead_peer_detected_with_replicas(spawn_farm, two_domains_4ranks):
    farm = spawn_farm(4)
    uid = bytes(kccl.get_unique_id())
    farm.run("hold", range(4), per_worker=[{"rank": r} for r in range(4)], uid=uid, nranks=4,
             config=dict(TIMEOUT, topo_file=two_domains_4ranks))
    pid = farm.pids[2]
    farm.kill(2)
    res = farm.run("release", [0, 1, 3], call=True)
    for out in res:
        assert out["type"] == "KcclRemoteError", out
        assert out["seconds"] < 2.0, out
    assert any("rank 2" in out["msg"] or f"pid {pid}" in out["msg"] for out in res), res


def test_ranks_must_agree_on_the_topology(spawn_farm, tmp_path):
    """Same number of domains, different domains (names): init fails on both ranks, naming the cause."""
    a = fake_l3s(tmp_path / "a.json", rank_domains=[0, 1])
    b = fake_l3s(tmp_path / "b.json", rank_domains=[0, 1], l3_base=4)
    farm = spawn_farm(2)
    uid = bytes(kccl.get_unique_id())
    for r, path in enumerate((a, b)):
        farm.submit(r, "topo_join", uid=uid, nranks=2, rank=r, config={"timeout_ms": 3000, "topo_file": path})
    errs = []
    for r in range(2):
        try:
            farm.result(r)
            errs.append(None)
        except WorkerTaskError as e:
            errs.append(str(e))
    assert all(errs), errs
    assert any("KcclInvalidUsage" in e and "same topology" in e for e in errs), errs


def test_topology_settings_refused_when_bad(tmp_path, monkeypatch):
    with pytest.raises(kccl.KcclInvalidArgument, match="KCCL_TOPO"):
        kccl.Communicator(1, kccl.get_unique_id(), 0, config={"topo": "sometimes"})
    with pytest.raises(kccl.KcclInvalidArgument, match="KCCL_TOPO_FILE"):
        kccl.Communicator(1, kccl.get_unique_id(), 0, config={"topo_file": str(tmp_path / "missing.json")})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv("KCCL_TOPO_FILE", str(bad))
    with pytest.raises(kccl.KcclInvalidArgument, match="not JSON"):
        kccl.Communicator(1, kccl.get_unique_id(), 0)
    # a file that pins 2 ranks used by a 1-rank communicator
    monkeypatch.setenv("KCCL_TOPO_FILE", fake_l3s(tmp_path / "two.json", rank_domains=[0, 1]))
    with pytest.raises(kccl.KcclInvalidArgument, match="pins 2 ranks"):
        kccl.Communicator(1, kccl.get_unique_id(), 0)
    monkeypatch.setenv("KCCL_TOPO", "off")  # off: the file is not even read
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as c:
        assert c.topo_info()["replicas"] == 0


def test_live_machine_placement():
    """Without a topology file the live machine decides: one domain (as on the project's VM)
    means one copy; several mean this rank gets the domain of its CPUs, and a lone rank has
    no peer to write a replica for."""
    import topology
    domains = topology.discover("/", live_gpus=False).cpu_domains()
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as c:
        c.all_reduce(np.ones(4, np.float32))
        info = c.topo_info()
    assert (info["replicas"], info["pushes"], info["replica_reads"]) == (0, 0, 0), info
    if len(domains) == 1 or len(domains) > 64:
        assert info["ndomains"] == 1, info
        if len(domains) == 1:
            assert info["plan"] == "one domain: one copy", info
    else:
        where = {cpu: d.index for d in domains for cpu in d.cpus}
        mine = {where[cpu] for cpu in os.sched_getaffinity(0) if cpu in where}
        assert (info["ndomains"], info["domain"]) == (len(domains), mine.pop() if len(mine) == 1 else -1), info


def test_c_placement_arguments_checked():
    from kccl._native import ffi, lib
    uid = ffi.new("kcclUniqueId *")
    assert lib.kcclGetUniqueId(uid) == 0
    cfg = ffi.new("kcclConfig_t *")
    assert lib.kcclConfigInit(cfg) == 0
    comm = ffi.new("kcclComm_t *")
    assert lib.kcclCommInitRankPlacement(comm, 1, uid[0], 0, cfg, ffi.NULL) == 4  # kcclInvalidArgument
    for field, value in (("size", 3), ("ndomains", 65), ("ndomains", -1), ("domain", 5), ("domain", -2)):
        pl = ffi.new("kcclPlacement_t *")
        pl.size, pl.ndomains, pl.domain = ffi.sizeof("kcclPlacement_t"), 2, 0
        setattr(pl, field, value)
        assert lib.kcclCommInitRankPlacement(comm, 1, uid[0], 0, cfg, pl) == 4, (field, value)
    pl = ffi.new("kcclPlacement_t *")
    pl.size, pl.ndomains, pl.domain = ffi.sizeof("kcclPlacement_t"), 2, 0
    pl.numaNode[1] = -5
    assert lib.kcclCommInitRankPlacement(comm, 1, uid[0], 0, cfg, pl) == 4
    info = ffi.new("kcclTopoInfo_t *")
    assert lib.kcclCommTopoInfo(ffi.NULL, info) == 4
