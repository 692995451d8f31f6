"""torch.distributed's "kccl" backend (kccl.torch): every call against gloo and a
reference on the same inputs (hypothesis, inside the ranks: tests/_torch_compare.py),
point-to-point, subgroups and mixed gloo / kccl groups, the init methods, async work and
futures, failures, leaks.

The ranks are real processes (tests/_torch_ranks.py launches them, the scenarios are in
tests/_torch_scenarios.py).  Starting torch takes seconds per process, so every scenario
is launched once, all of them together, by one module fixture; each test reads its
results.  The scenarios whose timing or /dev/shm view another could disturb run in a
second wave."""
import os
import sys
import threading

import pytest

torch = pytest.importorskip("torch", reason="kccl.torch needs torch (pip install -e '.[kie]' or '.[torch]')")

sys.path.insert(0, os.path.dirname(__file__))
from _torch_ranks import launch, launch_mpiexec  # noqa: E402

EXAMPLES = int(os.environ.get("KCCL_TORCH_TEST_EXAMPLES", "80"))

WAVE_A = {
    # hypothesis over collectives x dtypes x shapes x ops x roots; slots of 16 KB so that
    # the larger drawn tensors are chunked
    "compare2": dict(scenario="compare", world=2, args={"examples": EXAMPLES},
                     env={"KCCL_BUFFER_BYTES": "16384", "KCCL_P2P_BYTES": "4096"}),
    "compare3": dict(scenario="compare", world=3, args={"examples": EXAMPLES // 2}, init="file"),
    "refusals": dict(scenario="refusals", world=2),
    "groups_kccl": dict(scenario="groups", world=3),
    "groups_gloo": dict(scenario="groups", world=3, args={"default": "gloo"}, init="file"),
    "env": dict(scenario="env_init", world=2, init="env"),
    "pmi": dict(scenario="env_init", world=2, init="pmi"),
    "mpiexec": dict(scenario="env_init", world=2, mpiexec=True),
    "mixed_devices": dict(scenario="env_init", world=2, init="env", args={"backend": "cpu:kccl,cuda:nccl"}),
    "mismatch": dict(scenario="mismatch", world=2),
    "p2p2": dict(scenario="p2p", world=2),
    "p2p3": dict(scenario="p2p", world=3, init="file"),
}
WAVE_B = {
    "init_timeout_root": dict(scenario="init_timeout", world=2, args={"alone": 0, "timeout": 3}),
    "init_timeout_peer": dict(scenario="init_timeout", world=2, args={"alone": 1, "timeout": 3}),
    "lifecycle": dict(scenario="lifecycle", world=2),
    "async": dict(scenario="async", world=2, env={"KCCL_MAX_OUTSTANDING": "4"}),
    "dead": dict(scenario="dead_peer", world=3),
    "futures": dict(scenario="futures", world=2),
    "p2p_dead": dict(scenario="p2p_dead", world=3),
}


def _wave(jobs):
    out = {}

    def go(name, kw):
        run = launch_mpiexec if kw.pop("mpiexec", False) else launch
        out[name] = run(timeout=float(os.environ.get("KCCL_TORCH_TEST_TIMEOUT", "400")), **kw)

    threads = [threading.Thread(target=go, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import kccl.torch  # noqa: F401  (builds the extension once, before the ranks need it)
    WAVE_B["dead"]["args"] = {"death_file": str(tmp_path_factory.mktemp("dead") / "died_at")}
    WAVE_B["futures"]["args"] = {"death_file": str(tmp_path_factory.mktemp("futures") / "died_at")}
    WAVE_B["p2p_dead"]["args"] = {"death_file": str(tmp_path_factory.mktemp("p2p_dead") / "died_at")}
    res = _wave(WAVE_A)
    res.update(_wave(WAVE_B))
    return res


def ok(rr):
    """The results of ranks that all exited 0 (else fail, with their stderr)."""
    for r in rr:
        assert r.rc == 0 and r.result is not None, r
    return [r.result for r in rr]


@pytest.mark.parametrize("name", ["compare2", "compare3"])
def test_every_call_matches_gloo_and_the_reference(runs, name):
    results = ok(runs[name])
    for res in results:
        assert res["problems"] == []
        assert res["checked"] >= min(EXAMPLES // 3, 10)
        assert res["gloo_checked"] > 0 and res["exact"] > 0   # some compared bit for bit
        assert res["async"] > 0
    assert sum(res["sub"] for res in results) > 0  # some ran in a subgroup (not every rank is in it)


def test_unsupported_ops_raise_at_once_and_the_group_still_works(runs):
    for res in ok(runs["refusals"]):
        assert res["devices"] == ["cpu", "cuda"]
        for name in ("BAND", "PREMUL_SUM", "float8"):
            kind, msg, seconds = res[name]
            assert kind == "NotImplementedError" and "kccl" in msg and "not supported" in msg, (name, msg)
            assert seconds < 1.0
        assert res["complex_max"][0] == "ValueError"
        assert res["bool_avg"][0] == "ValueError" and "bool" in res["bool_avg"][1]
        assert res["kccl_tag"][0] == "ValueError" and "kccl's own" in res["kccl_tag"][1]
        if res["gpu_comm"] != "made":  # no GPU here: the init of a GPU communicator fails alike everywhere,
            # DistBackendError where KCCL was built without CUDA, ValueError (no such device) where it was
            assert res["gpu_comm"][0] in ("DistBackendError", "ValueError"), res
            assert "GPU communicator" in res["gpu_comm"][1], res
        assert res["after"] == [1.0, 1.0, 1.0]
        assert res["shm"] == []


@pytest.mark.parametrize("name", ["p2p2", "p2p3"])
def test_send_recv_and_their_async_and_batch_forms(runs, name):
    results = ok(runs[name])
    world = len(results)
    for rank, res in enumerate(results):
        prv = (rank - 1) % world
        assert res["tags"] == [10.0 * prv + 1, 10.0 * prv + 2]
        assert all(res["sizes"].values()), res["sizes"]
        assert res["batch_works"] == 1 and res["batch"]
        assert res["shm"] == []
    assert results[0]["any"] == list(range(1, world))
    assert results[1]["objects"] == [{"a": 1}, "two"]
    # the receive finished while the sender slept, before it waited for its send
    assert results[1]["recv_ok"] and results[1]["recv_done"] < results[0]["wait_started"]


def survivors(rr, victim=2):
    """The results of the ranks before the victim (which died), after checking that each
    raised DistBackendError naming it within 2 s of its death."""
    assert rr[victim].rc != 0
    out = []
    for r in rr[:victim]:
        assert r.rc == 0, r
        res = r.result
        assert res["raised"] == "DistBackendError", res
        assert f"rank {victim}" in res["msg"] and "died" in res["msg"]
        assert 0 <= res["after_death"] < 2.0
        out.append(res)
    return out


def test_a_dead_peer_fails_sends_and_receives_within_2s(runs):
    assert len(survivors(runs["p2p_dead"])) == 2


@pytest.mark.parametrize("name,default,side", [("groups_kccl", "kccl", "gloo"), ("groups_gloo", "gloo", "kccl")])
def test_subgroups_and_a_gloo_group_beside_kccl(runs, name, default, side):
    results = ok(runs[name])
    for rank, res in enumerate(results):
        assert res["backend"] == default and res["side_backend"] == side
        assert res["world"] == 6.0 and res["side"] == 6.0
        if rank % 2 == 0:  # the subgroup of the even ranks: 1 + 3
            assert res["sub"] == 4.0 and res["sub_rank"] == rank // 2
        else:
            assert "sub" not in res
        assert res["shm"] == []


@pytest.mark.parametrize("name", ["env", "pmi", "mixed_devices"])
def test_env_init_under_torchrun_and_mpiexec_variables(runs, name):
    results = ok(runs[name])
    assert sorted(r["rank"] for r in results) == [0, 1]
    for res in results:
        assert res["world"] == 2 and res["sum"] == 3.0
        assert "kccl" in res["backend"]


def test_under_mpiexec_with_master_addr_and_port(runs):
    if runs["mpiexec"] is None:
        pytest.skip("no mpiexec (the [dev] extra's mpich provides it)")
    rc, results, err = runs["mpiexec"]
    assert rc == 0, err[-3000:]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["sum"] == 3.0 and r["world"] == 2 and r["shm"] == [] for r in results)


def test_async_all_reduce_returns_before_the_late_peer_and_overlaps(runs):
    r0, r1 = ok(runs["async"])
    assert r0["returned_after"] < 0.25 and r0["completed_at_once"] is False  # the peer sleeps 0.5 s
    assert r0["done_after"] >= 0.4 and r0["wait"] is True
    for res in (r0, r1):
        assert res["sum"] == 3.0 and res["future"] == 3.0
        assert res["many"] == [1.0, 3.0, 5.0, 7.0]        # 4 in flight, waited in reverse order
        assert res["after_blocking"] == [True, 2.0]      # a blocking call completes them first
        assert res["big"] == 2.0                         # too large for a slot: still right
        assert res["split_phase"] >= 6                   # ... and the small ones went split-phase
        assert res["shm"] == []


def test_get_future_returns_at_once_and_completes_with_the_collective(runs):
    rr = runs["futures"]
    assert rr[1].rc != 0  # the victim of the last step
    assert rr[0].rc == 0, rr[0]
    res = rr[0].result
    assert res["returned_after"] < 0.25 and res["done_at_once"] is False  # the peer joins 0.5 s later
    assert res["done_after"] >= 0.4
    assert res["value"] == 3.0 and res["then"] == 6.0
    assert res["work_after_future"] == [True, True, 3.0]
    assert res["many"] == [1.0, 3.0, 5.0]
    assert res["finished_future"] == [True, 2.0]
    assert res["threads_left"] <= 0  # the thread that completed the futures has ended


def test_an_abort_or_a_dead_peer_fails_a_pending_future(runs):
    res = runs["futures"][0].result
    assert res is not None, runs["futures"][0]
    for e in res["abort"]:  # the future, a .then() on it, the Work
        assert e is not None and "aborted" in e["msg"], res["abort"]
    assert res["abort"][2]["type"] == "DistBackendError"
    dead = res["dead"]
    assert dead["error"] is not None and "rank 1" in dead["error"]["msg"] and "died" in dead["error"]["msg"]
    assert 0 <= dead["after_death"] < 2.0
    assert res["dead_work"] is not None and res["dead_work"]["type"] == "DistBackendError"


def test_a_dead_peer_makes_every_survivor_raise_within_2s_naming_it(runs):
    for res in survivors(runs["dead"]):
        assert "RuntimeError" in res["mro"]


def test_mismatched_calls_raise_on_every_rank(runs):
    for res in ok(runs["mismatch"]):
        assert res["raised"] == "DistBackendError" and "mismatch" in res["msg"]
        assert res["elapsed"] < 2.0
        assert res["shm"] == []


@pytest.mark.parametrize("name,alone", [("init_timeout_root", 0), ("init_timeout_peer", 1)])
def test_init_honours_the_group_timeout(runs, name, alone):
    res = ok(runs[name])[alone]
    assert res["raised"] == "DistBackendError"
    assert "3000" in res["msg"]
    assert 2.5 < res["elapsed"] < 3 + 5
    assert res["shm"] == []


def test_destroy_and_abort_leave_no_segment_thread_or_process(runs):
    for res in ok(runs["lifecycle"]):
        assert len(set(res["tasks"])) == 1  # three groups made and destroyed / aborted: no thread more
        assert res["shm_while_world"] == [] and res["shm"] == []
        assert res["children"] == 0


def test_ranks_from_launcher():
    import kccl.torch
    env = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}
    assert kccl.torch.ranks_from_launcher(env) == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert env["RANK"] == "1"
    env = {"RANK": "0", "PMI_RANK": "3", "PMI_SIZE": "4"}
    assert kccl.torch.ranks_from_launcher(env) == {} and env["RANK"] == "0"
    assert kccl.torch.ranks_from_launcher({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}) == \
        {"RANK": "2", "WORLD_SIZE": "3"}
