"""topology/: discovery on the fixture machines, chip models, placement plans, the cost
model, the CLI, and typed errors for malformed trees, files and rank counts.  Pure Python
(no communicator), so it runs in a few seconds."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import topology
from topology import chips, cost
from topology.fixtures import build as fixtures
from topology.plan import cpu_count
from topology.sysfs import parse_cpu_list

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    dest = tmp_path_factory.mktemp("fixtures")
    return {name: fixtures.build(name, str(dest)) for name in fixtures.FIXTURES}


def machine(trees, name):
    return topology.discover(trees[name], nvml_json=fixtures.nvml_json(name))


def counts(t):
    return {k: len(t.of_kind(k)) for k in ("package", "numa", "l3", "core", "gpu", "gpu_iod", "gpu_die", "l2_partition")}


# -- discovery ------------------------------------------------------------------------------------

def test_epyc_nps4(trees):
    t = machine(trees, "epyc9654-2s-nps4")
    assert counts(t) == dict(package=2, numa=8, l3=24, core=192, gpu=0, gpu_iod=0, gpu_die=0, l2_partition=0)
    assert len(t.nodes["machine"].attrs["online_cpus"]) == 384
    doms = t.cpu_domains()
    assert len(doms) == 24 and all(len(d.cpus) == 16 for d in doms)  # a CCD: 8 cores x 2 threads
    assert doms[0].cpus == frozenset(list(range(0, 8)) + list(range(192, 200)))
    assert [d.numa for d in doms[:6]] == [0, 0, 0, 1, 1, 1]  # 3 CCDs per NPS4 node
    assert (t.numa_distance(0, 0), t.numa_distance(0, 1), t.numa_distance(0, 4)) == (10, 12, 32)
    core = t.nodes["core:0"]
    assert core.attrs["cpus"] == [0, 192] and t.nodes["l3:0"].attrs["size_bytes"] == 32 << 20


def test_xeon_snc_domain_is_the_numa_node_inside_a_shared_l3(trees):
    t = machine(trees, "xeon8480-2s-snc4")
    assert counts(t)["l3"] == 2 and counts(t)["numa"] == 8 and counts(t)["core"] == 112
    doms = t.cpu_domains()
    assert len(doms) == 8 and all(len(d.cpus) == 28 for d in doms)
    assert [d.key for d in doms[:2]] == ["l3:0/numa:0", "l3:0/numa:1"]
    assert t.numa_distance(0, 7) == 21


def test_mi300x_node(trees):
    t = machine(trees, "mi300x-8")
    c = counts(t)
    assert (c["gpu"], c["gpu_iod"], c["gpu_die"]) == (8, 32, 64)
    assert len(t.cpu_domains()) == 16  # host: 2 x 8 CCDs, NPS1
    g = t.nodes["gpu:0"].attrs
    assert (g["model"], g["cu_count"], g["num_xcc"], g["numa"]) == ("MI300X", 304, 8, 0)
    assert t.nodes["gpu:4"].attrs["numa"] == 1 and t.nodes["gpu:0"].attrs["pci_bus_id"] == "0000:05:00.0"
    pairs = [[x.id.split("/")[-1] for x in t.children(f"gpu:0/iod:{i}")] for i in range(4)]
    assert pairs == [["xcd:0", "xcd:1"], ["xcd:2", "xcd:3"], ["xcd:4", "xcd:5"], ["xcd:6", "xcd:7"]]
    assert all(t.nodes[f"gpu:3/xcd:{x}"].attrs["cus"] == 38 for x in range(8))
    xgmi = t.links_of("xgmi")
    assert len(xgmi) == 56 and {l.distance for l in xgmi} == {15.0}


def test_h200_node(trees):
    t = machine(trees, "h200-8")
    c = counts(t)
    assert (c["gpu"], c["l2_partition"], c["numa"]) == (8, 16, 2)
    assert len(t.cpu_domains()) == 2
    g = t.nodes["gpu:5"].attrs
    assert (g["sm_count"], g["l2_bytes"], g["numa"], g["model"]) == (132, 50 << 20, 1, "H200")
    nv = t.links_of("nvlink")
    assert len(nv) == 56 and {l.attrs["links"] for l in nv} == {18}


def test_this_machine_fixture(trees):
    t = topology.discover(trees["this-machine"])
    assert counts(t)["core"] == 2 and [d.key for d in t.cpu_domains()] == ["l3:0/numa:0"]
    assert t.allowed_cpus == frozenset({0, 1})


def test_a_capture_of_the_live_machine_reads_back_the_same(tmp_path):
    from topology import capture
    capture.capture(str(tmp_path / "cap"))
    captured = topology.discover(str(tmp_path / "cap"), live_gpus=False)
    live = topology.discover("/", live_gpus=False)
    assert [(d.key, d.numa, d.cpus) for d in captured.cpu_domains()] == [(d.key, d.numa, d.cpus) for d in live.cpu_domains()]
    assert live.allowed_cpus == frozenset(os.sched_getaffinity(0)) == captured.allowed_cpus


def test_json_round_trip(trees, tmp_path):
    t = machine(trees, "mi300x-8")
    path = tmp_path / "t.json"
    topology.dump(t, str(path), rank_domains=[0, 3])
    t2, rd = topology.load(str(path))
    assert rd == [0, 3] and t2.to_dict()["nodes"] == t.to_dict()["nodes"] and len(t2.links) == len(t.links)
    assert [d.cpus for d in t2.cpu_domains()] == [d.cpus for d in t.cpu_domains()]


# -- chip models -------------------------------------------------------------------------------------

def test_chip_models():
    m = chips.MI300X
    assert (m.dies, m.units_per_die, m.compute_units, m.l2_bytes_per_die) == (8, 38, 304, 4 << 20)
    assert m.die_groups == ((0, 1), (2, 3), (4, 5), (6, 7)) and m.hbm_stacks_per_group == 2
    assert m.memory_side_cache_bytes == 256 << 20 and m.l2_private_per_die and m.replica_domains == 4
    assert [chips.iod_of_xcd(m, x) for x in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    for h in (chips.H100, chips.H200):
        assert (h.compute_units, h.l2_partitions, h.replica_domains) == (132, 2, 2)
    assert chips.lookup("NVIDIA H100 80GB HBM3") is chips.H100 and chips.lookup("NVIDIA H200") is chips.H200
    assert chips.lookup("Tesla T4") is None
    with pytest.raises(topology.TopologyError):
        chips.iod_of_xcd(m, 8)


# -- plans --------------------------------------------------------------------------------------------

def _check_rule(p):
    """Every reader polls a copy in its own domain (or a domain-less reader the writer's own);
    every peer of a writer reads exactly one copy; one copy per domain spanned."""
    for w, reps in enumerate(p.replicas):
        seen = []
        for rep in reps:
            for r in rep.readers:
                d = p.rank_domain[r]
                assert d == rep.domain or (d is None and rep.own), (w, r, rep)
            seen += rep.readers
        assert sorted(seen) == [r for r in range(p.nranks) if r != w], (w, seen)
        assert len({rep.domain for rep in reps}) == len(reps)
        assert len(reps) == len(p.domains) + (p.rank_domain[w] is None)


def test_plan_on_one_domain_is_one_copy(trees):
    for name in ("this-machine",):
        t = machine(trees, name)
        for n in (1, 2):
            p = topology.plan(n, t)
            assert p.single_copy and p.copies_per_flag == 1
            _check_rule(p)
            assert cost.transfers(p, 8) == {"single": 0, "replicated": 0, "replicated_plain_stores": 0}


def test_plans_on_fixture_machines(trees):
    t = machine(trees, "epyc9654-2s-nps4")
    p = topology.plan(16, t)  # compact: cores 0-15, two CCDs
    assert [d.ranks for d in p.domains] == [list(range(8)), list(range(8, 16))]
    assert [(r.domain, r.numa, r.own) for r in p.replicas[0]] == [(0, 0, True), (1, 0, False)]
    for name in ("epyc9654-2s-nps4", "xeon8480-2s-snc4", "mi300x-8", "h200-8"):
        t = machine(trees, name)
        for n in (8, 24, 64):
            _check_rule(topology.plan(n, t))
        _check_rule(topology.plan(cost.scatter_cpus(t, 16), t))


def test_plan_rank_cpu_sets_and_explicit_domains(trees):
    t = machine(trees, "epyc9654-2s-nps4")
    p = topology.plan([{0, 192}, {8}, set(range(384)), 9], t)  # an SMT pair, a core, unpinned, a core
    assert p.rank_domain == [0, 1, None, 1]
    _check_rule(p)
    p = topology.plan([0, 1, 2], t, rank_domains=[5, 5, -1])
    assert p.rank_domain == [5, 5, None]
    _check_rule(p)


def test_gpu_plans(trees):
    t = machine(trees, "h200-8")
    p = topology.plan([f"gpu:{i}" for i in range(8)], t)
    assert len(p.domains) == 8 and p.copies_per_flag == 8
    assert all(len(r.sub) == 2 for r in p.replicas[0])  # a copy per L2 partition inside each GPU
    _check_rule(p)
    t = machine(trees, "mi300x-8")
    p = topology.plan(["gpu:0", "gpu:0", "gpu:1"], t)  # two ranks on one GPU (MPS-like)
    assert p.rank_domain == [0, 0, 1] and len(p.replicas[0][0].sub) == 4
    _check_rule(p)


@pytest.mark.parametrize("ranks", [0, -3, 10 ** 6, True, 2.5, "x", [], [None], [999], ["gpu:0"]])
def test_plan_refuses_nonsense(trees, ranks):
    t = machine(trees, "epyc9654-2s-nps4")
    with pytest.raises(topology.TopologyError):
        topology.plan(ranks, t)


def test_plan_refuses_bad_rank_domains(trees):
    t = machine(trees, "this-machine")
    with pytest.raises(topology.TopologyError):
        topology.plan(2, t, rank_domains=[0])
    with pytest.raises(topology.TopologyError):
        topology.plan(2, t, rank_domains=[0, 3])


# -- cost model ---------------------------------------------------------------------------------------

RANKS = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192)


@pytest.mark.parametrize("name", ["epyc9654-2s-nps4", "xeon8480-2s-snc4", "mi300x-8", "h200-8", "this-machine"])
def test_replicated_never_costs_more(trees, name):
    t = machine(trees, name)
    for placement in ("compact", "scatter"):
        for nbytes in (0, 8, 56, 1024, 16384, 16385, 1 << 20):
            for row in cost.table(t, RANKS + (1, 2), nbytes, placement):
                assert row["replicated"] <= row["single"], (name, placement, nbytes, row)
                if row["domains"] == 1:
                    assert row["single"] == row["replicated"] == 0, row


def test_cost_model_by_hand(trees):
    t = machine(trees, "epyc9654-2s-nps4")
    rows = {r["ranks"]: r for r in cost.table(t, [8, 16, 192])}
    assert rows[8]["single"] == 0  # one CCD
    # 16 ranks on 2 CCDs: each writer has 8 remote readers (single copy), 1 remote domain (replicated)
    assert (rows[16]["single"], rows[16]["replicated"], rows[16]["replicated_plain_stores"]) == (128, 16, 144)
    # 192 ranks on 24 CCDs: 184 remote readers vs 23 remote domains per writer
    assert (rows[192]["single"], rows[192]["replicated"]) == (192 * 184, 192 * 23)
    # a 1 KB message is 17 lines (8-byte flag + 1024 bytes): every count scales by 17
    assert cost.table(t, [16], 1024)[0]["single"] == 128 * 17
    # scattered ranks, one per domain: replicas save nothing (and plain stores would double the cost)
    r = cost.table(t, [24], 8, "scatter")[0]
    assert r["single"] == r["replicated"] == 24 * 23 and r["replicated_plain_stores"] == 2 * r["single"]
    # above 16 KB nothing is replicated: both plans cost the same
    big = cost.table(t, [16], 16385)[0]
    assert big["single"] == big["replicated"] == 128 * cost.lines_of(16385)
    with pytest.raises(topology.TopologyError):
        cost.lines_of(-1)


# -- malformed input ---------------------------------------------------------------------------------

def _copy(trees, name, tmp_path):
    dest = tmp_path / name
    shutil.copytree(trees[name], dest)
    return dest


@pytest.mark.parametrize("breakage", [
    ("sys/devices/system/cpu/online", None),
    ("sys/devices/system/cpu/online", "zero-one"),
    ("sys/devices/system/cpu/online", "5-2"),
    ("sys/devices/system/cpu/cpu1/topology/core_id", "first"),
    ("sys/devices/system/cpu/cpu0/topology/physical_package_id", None),
    ("sys/devices/system/cpu/cpu0/topology/thread_siblings_list", "1"),
    ("sys/devices/system/cpu/cpu0/cache/index3/shared_cpu_list", "0-1,x"),
    ("sys/devices/system/node/node0/distance", "10 20"),
    ("sys/devices/system/node/node0/distance", "ten"),
    ("sys/devices/system/node/node0/cpulist", "a-b"),
])
def test_malformed_sysfs_tree(trees, tmp_path, breakage):
    root = _copy(trees, "this-machine", tmp_path)
    rel, text = breakage
    if text is None:
        os.remove(root / rel)
    else:
        (root / rel).write_text(text + "\n")
    with pytest.raises(topology.TopologyError) as ei:
        topology.discover(str(root))
    assert isinstance(ei.value, ValueError)


def test_not_a_tree_at_all(tmp_path):
    with pytest.raises(topology.TopologyError, match="missing"):
        topology.discover(str(tmp_path))


@pytest.mark.parametrize("line", ["simd_count lots", "simd_count", "simd_per_cu 0", "num_xcc 7"])
def test_malformed_kfd_tree(trees, tmp_path, line):
    root = _copy(trees, "mi300x-8", tmp_path)
    props = root / "sys/class/kfd/kfd/topology/nodes/3/properties"
    key = line.split()[0]
    text = "\n".join(l for l in props.read_text().splitlines() if not l.startswith(key + " ")) + "\n" + line + "\n"
    props.write_text(text)
    with pytest.raises(topology.TopologyError):
        topology.discover(str(root))


@pytest.mark.parametrize("doc", ["{", "[]", '{"format": "kccl-nvml/1"}',
                                 '{"format": "kccl-nvml/1", "gpus": [{"index": 0, "name": "x"}], "links": []}',
                                 '{"format": "kccl-nvml/1", "gpus": [{"index": 1, "name": "x"}], "links": [[null]]}',
                                 '{"format": "kccl-nvml/1", "gpus": [{"index": 0, "name": "x"}, {"index": 1, "name": "y"}],'
                                 ' "links": [[null, "carrier-pigeon"], [null, null]]}'])
def test_malformed_nvml_json(trees, tmp_path, doc):
    p = tmp_path / "nvml.json"
    p.write_text(doc)
    with pytest.raises(topology.TopologyError):
        topology.discover(trees["this-machine"], nvml_json=str(p))


@pytest.mark.parametrize("doc", ["", "{", "[1]", '{"format": "other"}', '{"format": "kccl-topology/1"}',
                                 '{"format": "kccl-topology/1", "nodes": [{"id": "core:0", "kind": "core"}], "links": []}',
                                 '{"format": "kccl-topology/1", "nodes": [{"id": "x", "kind": "planet"}], "links": []}',
                                 '{"format": "kccl-topology/1", "nodes": [], "links": [{"a": "machine", "b": "nope", "kind": "contains"}]}'])
def test_malformed_topology_file(tmp_path, doc):
    p = tmp_path / "t.json"
    p.write_text(doc)
    with pytest.raises(topology.TopologyError):
        topology.load(str(p))


def test_topology_file_bad_rank_domains(trees, tmp_path):
    t = machine(trees, "this-machine")
    for rd in ([0, 1], ["a"], [True], 3):
        d = t.to_dict()
        d["rank_domains"] = rd
        p = tmp_path / "t.json"
        p.write_text(json.dumps(d))
        with pytest.raises(topology.TopologyError, match="rank_domains"):
            topology.load(str(p))
    with pytest.raises(topology.TopologyError):
        topology.load(str(tmp_path / "absent.json"))


def test_cpu_list_parser():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11] and parse_cpu_list("") == []
    for bad in ("1-", "-1", "a", "3-1", "0,,1"):
        with pytest.raises(topology.TopologyError):
            parse_cpu_list(bad)


# -- the CLI ------------------------------------------------------------------------------------------

def _cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "topology", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_cli_tree_plan_cost_and_json(trees, tmp_path):
    p = _cli("--root", trees["epyc9654-2s-nps4"], "--plan", "16", "--cost", "8,16,192")
    assert p.returncode == 0, p.stderr
    assert "24 cache domain(s)" in p.stdout and "2 of 24 domains spanned" in p.stdout
    assert "l3 23 (32 MiB)" in p.stdout and re.search(r"^\s*192\s+24\s+35328\s+4416\s", p.stdout, re.M)
    p = _cli("--plan", "1")  # the live machine
    assert p.returncode == 0 and "plan for 1 cpu ranks" in p.stdout and "one copy" in p.stdout, p.stdout + p.stderr
    out = tmp_path / "t.json"
    p = _cli("--root", trees["h200-8"], "--nvml", fixtures.nvml_json("h200-8"),
             "--plan", "gpu:0,gpu:7", "--json", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["plan"]["kind"] == "gpu" and len(doc["plan"]["domains"]) == 2
    t, _ = topology.load(str(out))
    assert len(t.of_kind("gpu")) == 8


def test_cli_plans_more_ranks_than_cpus_and_prints_every_cost_row(trees):
    """On a 2-CPU machine a 4-rank communicator works (its waits yield): the plan places it,
    and --cost prints a row for every count asked for."""
    p = _cli("--root", trees["this-machine"], "--plan", "4", "--cost", "1,2,4,8")
    assert p.returncode == 0, p.stderr
    assert "plan for 4 cpu ranks" in p.stdout and "oversubscribed: 4 ranks on 2 CPUs" in p.stdout, p.stdout
    for n in (1, 2, 4, 8):
        assert re.search(rf"^\s*{n}\s+1\s+0\s+0\s", p.stdout, re.M), (n, p.stdout)
    assert "* more ranks than CPUs" in p.stdout


@pytest.mark.parametrize("name", ["this-machine", "epyc9654-2s-nps4", "xeon8480-2s-snc4"])
def test_oversubscribed_plan_takes_the_domains_of_shared_cpus(trees, name):
    t = machine(trees, name)
    ncpu = cpu_count(t)
    n = 2 * ncpu + 3
    p = topology.plan(n, t)
    one = topology.plan(ncpu, t)
    assert p.nranks == n and p.oversubscribed == n - ncpu
    assert p.rank_domain == [one.rank_domain[r % ncpu] for r in range(n)]
    assert one.oversubscribed == 0
    for placement in ("compact", "scatter"):
        rows = cost.table(t, [1, ncpu, n], 8, placement)
        assert [r["ranks"] for r in rows] == [1, ncpu, n]
        assert rows[-1]["shared"] > 0 and rows[0]["shared"] == 0


@pytest.mark.parametrize("args", [["--root", "/nonexistent"], ["--plan", "0"], ["--plan", "many"],
                                  ["--file", "/nonexistent.json"], ["--cost", "0"]])
def test_cli_errors(args):
    p = _cli(*args)
    assert p.returncode == 2 and p.stderr.startswith("error:"), (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr


# -- live NVML path, against a stand-in pynvml (the real library is optional and absent here) ----------

class _FakeNvml:
    """The few nvidia-ml-py calls topology.nvml.capture() makes, for 2 GPUs joined by 18 NVLinks."""
    NVML_P2P_CAPS_INDEX_READ, NVML_P2P_CAPS_INDEX_NVLINK = 0, 2
    NVML_P2P_STATUS_OK, NVML_FEATURE_ENABLED, NVML_NVLINK_MAX_LINKS = 0, 1, 18

    class NVMLError(Exception):
        pass

    class _Obj:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    def __init__(self):
        self.inited = 0

    def nvmlInit(self):
        self.inited += 1

    def nvmlShutdown(self):
        self.inited -= 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetPciInfo(self, h):
        return self._Obj(busId=f"00000000:{0x18 + h:02X}:00.0".encode())

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._Obj(total=141 << 30)

    def nvmlDeviceGetNumaNodeId(self, h):
        raise self.NVMLError("not supported")  # old drivers: numa stays unknown

    def nvmlDeviceGetAttributes(self, h):
        return self._Obj(multiprocessorCount=132)

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        return 0

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 1

    def nvmlSystemGetDriverVersion(self):
        return "fake"


def test_live_nvml_path_with_a_stand_in(monkeypatch, trees):
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    doc = topology.nvml.capture()
    assert fake.inited == 0  # shut down again
    assert [g["pci_bus_id"] for g in doc["gpus"]] == ["00000000:18:00.0", "00000000:19:00.0"]
    assert doc["links"] == [[None, "nvlink:18"], ["nvlink:18", None]]
    t = topology.discover(trees["this-machine"], live_gpus=True)
    assert [n.attrs["sm_count"] for n in t.of_kind("gpu")] == [132, 132]
    assert t.nodes["gpu:1"].attrs["numa"] is None and len(t.of_kind("l2_partition")) == 4


def test_nvml_absent_is_optional(monkeypatch, trees):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as if not installed
    assert topology.discover(trees["this-machine"]).of_kind("gpu") == []
    live = topology.discover("/")  # live: NVML quietly skipped (KFD GPUs, on an AMD box, would remain)
    assert [g for g in live.of_kind("gpu") if g.attrs["vendor"] == "NVIDIA"] == []
    with pytest.raises(topology.TopologyError, match="nvidia-ml-py"):
        topology.discover(trees["this-machine"], live_gpus=True)
