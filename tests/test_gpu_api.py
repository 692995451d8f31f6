"""The GPU transport's surface, checked where there is no GPU (CI) and where there is one.

Without a GPU: the build contains the CUDA code when asked (KCCL_CUDA=1), asking for a
device gives a clear error, GPU-array descriptions (__cuda_array_interface__,
streams) are parsed and refused as they should be.  With a GPU (and mpiexec): the
multi-rank checks of tests/gpu/ run (they are also run by hand under MPS, see
bench/RESULTS.md)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import kccl
from kccl import _cuda_buffers as cu
from kccl._build_cuda import find_nvcc
from kccl.communicator import cuda_build_plan
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import kccl_bench  # noqa: E402  (bench/kccl_bench.py)

HERE = os.path.dirname(os.path.abspath(__file__))
BUILT, NDEV = kccl.gpu_support()


def test_cuda_code_is_built_where_it_can_run_or_when_asked():
    """KCCL_CUDA=1 builds it; auto only where nvcc AND a GPU driver are (kccl/_build_cuda.py),
    as the build saw them: the library records KCCL_CUDA, nvcc and the driver of its build."""
    plan = cuda_build_plan()
    expect = plan["mode"] == "1" or (plan["mode"] == "auto" and plan["nvcc"] is not None and
                                     plan["driver"] is not None)
    assert plan["build"] == expect and BUILT == expect, plan


def test_the_build_rule_check_ignores_the_environment_of_the_test():
    """The check above read KCCL_CUDA when the test ran, so a user who built with KCCL_CUDA=1
    and ran pytest without it saw it fail: run it with the opposite setting."""
    test = os.path.abspath(__file__) + "::test_cuda_code_is_built_where_it_can_run_or_when_asked"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                       env=dict(os.environ, KCCL_CUDA="0" if BUILT else "1"), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]


@pytest.mark.skipif(NDEV > 0, reason="a GPU is visible")
def _no_device_error():
    """What asking for device 0 raises here: no device seen (a CUDA build), or no CUDA in the
    build (KCCL_CUDA=auto builds none where no GPU driver is)."""
    if BUILT:
        return pytest.raises(kccl.KcclInvalidArgument, match="sees 0 CUDA device")
    return pytest.raises(kccl.KcclInvalidUsage, match="built without CUDA .*KCCL_CUDA=1")


def test_asking_for_a_gpu_without_one_is_a_clear_error():
    with _no_device_error():
        kccl.Communicator(1, kccl.get_unique_id(), 0, device=0)


@pytest.mark.skipif(NDEV > 0, reason="a GPU is visible")
def _init_one_rank_with(**fields):
    """kcclCommInitRankConfig of a 1-rank communicator whose config (from
    kcclConfigInit) has `fields` changed: (result code, error text, handle)."""
    from kccl._native import ffi, lib
    cfg = ffi.new("kcclConfig_t *")
    assert lib.kcclConfigInit(cfg) == 0
    for name, value in fields.items():
        setattr(cfg, name, value)
    uid = ffi.new("kcclUniqueId *")
    assert lib.kcclGetUniqueId(uid) == 0
    comm = ffi.new("kcclComm_t *")
    rc = lib.kcclCommInitRankConfig(comm, 1, uid[0], 0, cfg)
    return rc, ffi.string(lib.kcclGetLastError(ffi.NULL)), comm[0]


def test_c_api_refuses_a_missing_device_and_leaves_nothing():
    from kccl._native import ffi, lib
    cfg = ffi.new("kcclConfig_t *")
    assert lib.kcclConfigInit(cfg) == 0 and cfg.device == -1
    rc, msg, comm = _init_one_rank_with(device=3)
    assert rc == (kccl.errors.INVALID_ARGUMENT if BUILT else kccl.errors.INVALID_USAGE)
    assert b"device" in msg
    assert comm == ffi.NULL


def test_c_api_refuses_a_negative_device_other_than_host():
    from kccl._native import ffi
    rc, msg, comm = _init_one_rank_with(device=-2)
    assert rc == kccl.errors.INVALID_ARGUMENT
    assert b"config.device=-2" in msg
    assert comm == ffi.NULL


@pytest.mark.parametrize("device", [-1, -5, "cuda:x", "gpu0", True, 1.0, [0]])
def test_bad_device_arguments(device):
    with pytest.raises(kccl.KcclInvalidArgument):
        kccl.Communicator(1, kccl.get_unique_id(), 0, device=device)


def test_host_communicator_reports_no_device_and_refuses_device_calls():
    from kccl._native import ffi, lib
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as comm:
        assert comm.device is None
        dev = ffi.new("int *")
        assert lib.kcclCommCuDevice(comm._comm, dev) == 0 and dev[0] == -1
        with pytest.raises(kccl.KcclInvalidUsage, match="host communicator"):
            comm.dev_comm()
        with pytest.raises(kccl.KcclInvalidArgument, match="stream"):
            comm.all_reduce(np.ones(4, np.float32), stream=0)
        with pytest.raises(kccl.KcclInvalidArgument, match="stream"):
            comm.barrier(stream=0)
        # The GPU benchmarks and probes refuse a host communicator the same way.
        with pytest.raises(kccl.KcclInvalidUsage, match="host communicator"):
            kccl_bench.bench_residency(comm, 8)
        with pytest.raises(kccl.KcclInvalidUsage, match="host communicator"):
            kccl_bench.bench_device_all_reduce_phases(comm, FakeCudaArray((4,)))
        # Argument errors come first, on any communicator.
        bl, bffi = kccl_bench._lib, kccl_bench._ffi
        assert bl.kb_bench_residency(comm._comm, 8, 100, 0, -1, bffi.NULL, bffi.NULL) == kccl.errors.INVALID_ARGUMENT
        for blocks, timeout_ms, foreign, carveout, what in (
                (0, 100, 0, -1, "blocks=0"), (4097, 100, 0, -1, "blocks=4097"), (8, 0, 0, -1, "timeout"),
                (8, 60001, 0, -1, "timeout"), (8, 100, -1, -1, "foreign=-1"), (8, 100, 3, -1, "foreign=3"),
                (8, 100, 0, -2, "carveout=-2"), (8, 100, 0, 101, "carveout=101")):
            with pytest.raises(kccl.KcclInvalidArgument, match=what):
                kccl_bench.bench_residency(comm, blocks, timeout_ms, foreign, carveout)
        assert bl.kb_bench_dev_all_reduce_phases(bffi.NULL, 4, lib.kcclFloat32, 10, 1, comm._comm,
                                                 bffi.NULL) == kccl.errors.INVALID_ARGUMENT
        # The group self-test: arguments first, then the host communicator; no results without them.
        with pytest.raises(kccl.KcclInvalidUsage, match="host communicator"):
            kccl_bench.device_all_reduce_group_selftest(comm)
        with pytest.raises(kccl.KcclInvalidUsage, match="host communicator"):
            kccl_bench.device_all_reduce_group_selftest(comm, cancel="before")
        with pytest.raises(kccl.KcclInvalidArgument, match="reducers=9"):
            kccl_bench.device_all_reduce_group_selftest(comm, blocks=8, reducers=9)
        assert bl.kb_dev_group_selftest(lib.kcclFloat32, 0, 16, 1, 1, 1, 1, 0, 0, 0, comm._comm, bffi.NULL,
                                        bffi.new("double *")) == kccl.errors.INVALID_ARGUMENT
        assert bl.kb_bench_dev_all_reduce_phases(bffi.NULL, 4, lib.kcclFloat32, 0, 1, comm._comm,
                                                 bffi.new("double[4]")) == kccl.errors.INVALID_ARGUMENT


class FakeCudaArray:
    """Only the description: nothing here is ever dereferenced."""

    def __init__(self, shape, typestr="<f4", strides=None, readonly=False, ptr=0x7f0000001000):
        self.__cuda_array_interface__ = dict(shape=shape, typestr=typestr, strides=strides,
                                             data=(ptr, readonly), version=3)


def test_gpu_array_on_a_host_communicator_is_refused():
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as comm:
        with pytest.raises(kccl.KcclInvalidArgument, match="GPU array"):
            comm.all_reduce(FakeCudaArray((4,)))


@pytest.mark.parametrize("typestr,code,count", [("<f4", 7, 12), ("<f2", 6, 12), ("<f8", 8, 12), ("|i1", 0, 12),
                                                ("<i8", 4, 12), ("<u4", 3, 12)])
def test_cuda_array_interface_types(typestr, code, count):
    ptr, n, c, dev, lib = cu.resolve_cuda_buffer(FakeCudaArray((3, 4), typestr), None, True, "send")
    assert (ptr, n, c, dev) == (0x7f0000001000, count, code, None)


def test_cuda_array_interface_refusals():
    with pytest.raises(kccl.KcclInvalidArgument, match="C-contiguous"):
        cu.resolve_cuda_buffer(FakeCudaArray((3, 4), "<f4", strides=(4, 12)), None, True, "send")
    with pytest.raises(kccl.KcclInvalidArgument, match="read-only"):
        cu.resolve_cuda_buffer(FakeCudaArray((4,), readonly=True), None, True, "recv")
    cu.resolve_cuda_buffer(FakeCudaArray((4,), readonly=True), None, False, "send")  # a read-only send is fine
    with pytest.raises(kccl.KcclInvalidArgument, match="does not handle"):
        cu.resolve_cuda_buffer(FakeCudaArray((4,), "<c8"), None, True, "send")
    # explicit C strides, and strides of a 1-element array, are contiguous
    cu.resolve_cuda_buffer(FakeCudaArray((3, 4), "<f4", strides=(16, 4)), None, True, "send")
    cu.resolve_cuda_buffer(FakeCudaArray((1, 1), "<f4", strides=(400, 8)), None, True, "send")


def test_bfloat16_through_uint16_storage():
    ptr, n, code, _dev, _lib = cu.resolve_cuda_buffer(FakeCudaArray((10,), "<u2"), "bfloat16", True, "send")
    assert (n, code) == (10, 9)
    with pytest.raises(kccl.KcclInvalidArgument, match="2-byte items"):
        cu.resolve_cuda_buffer(FakeCudaArray((10,), "<f4"), "bfloat16", True, "send")


class FakeTorchStream:
    cuda_stream = 0x1234


class FakeCupyStream:
    ptr = 0x5678


class ProtocolStream:
    def __cuda_stream__(self):
        return (0, 0x9abc)


def test_stream_handles():
    assert cu.stream_handle(None, "cai", 0) == 0
    assert cu.stream_handle(7, "cai", 0) == 7
    assert cu.stream_handle(FakeTorchStream(), "cai", 0) == 0x1234
    assert cu.stream_handle(FakeCupyStream(), "cai", 0) == 0x5678
    assert cu.stream_handle(ProtocolStream(), "cai", 0) == 0x9abc
    for bad in ("s", 1.5, True, object()):
        with pytest.raises(kccl.KcclInvalidArgument):
            cu.stream_handle(bad, "cai", 0)


def test_device_header_and_compat_header_compile_as_cuda(tmp_path):
    """A user kernel that calls the device API compiles, whole blocks and a group of a
    block's threads (and so does the compat header)."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    src = tmp_path / "user.cu"
    src.write_text('#include "kccl_device.cuh"\n'
                   "__global__ void k(kcclDevComm dc, float *x, int n) {\n"
                   "  kcclResult_t r = kcclDevAllReduce(dc, x + blockIdx.x * n, n, kcclFloat32, kcclSum);\n"
                   "  if (r != kcclSuccess && threadIdx.x == 0) x[0] = -1;\n}\n"
                   "__global__ void g(kcclDevComm dc, float *x, int n, const unsigned *stop) {\n"
                   "  __shared__ float s[512];\n"
                   "  if (threadIdx.x >= 128) return;  // the other warps stay out\n"
                   "  for (int i = threadIdx.x; i < n; i += 128) s[i] = x[i];\n"
                   "  kcclDevGroup grp = {(int)blockIdx.x % KCCL_DEV_MAX_BLOCKS, 1, 128, stop};\n"
                   "  kcclResult_t r = kcclDevAllReduceGroup<8>(dc, grp, s, n, kcclBfloat16, kcclMax);\n"
                   "  if (r != kcclSuccess && threadIdx.x == 0) x[0] = -1;\n}\n")
    inc = os.path.join(os.path.dirname(HERE), "kccl_native", "include")
    p = subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-I", inc, "-c", str(src),
                        "-o", str(tmp_path / "user.o")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr


# -- per-L2-partition flag replicas (KCCL_GPU_FLAG_REPLICAS): what can be checked without a GPU --

def test_flag_replicas_query_on_a_host_communicator_is_a_clear_error():
    from kccl._native import ffi, lib
    with kccl.Communicator(1, kccl.get_unique_id(), 0, config={"gpu_flag_replicas": 1}) as comm:
        with pytest.raises(kccl.KcclInvalidUsage, match="host communicator"):
            comm.gpu_flag_replicas()
        assert lib.kcclCommGpuFlagReplicas(comm._comm, ffi.NULL, ffi.NULL, 0) == kccl.errors.INVALID_ARGUMENT
    state = ffi.new("int *")
    assert lib.kcclCommGpuFlagReplicas(ffi.NULL, state, ffi.NULL, 0) == kccl.errors.INVALID_ARGUMENT
    with pytest.raises(kccl.KcclInvalidUsage, match="closed"):
        comm.gpu_flag_replicas()


def test_c_api_refuses_an_invalid_flag_replicas_value():
    from kccl._native import ffi, lib
    cfg = ffi.new("kcclConfig_t *")
    assert lib.kcclConfigInit(cfg) == 0 and cfg.gpu_flag_replicas == 0
    rc, msg, comm = _init_one_rank_with(gpu_flag_replicas=2)
    assert rc == kccl.errors.INVALID_ARGUMENT
    assert b"gpu_flag_replicas" in msg
    assert comm == ffi.NULL


@pytest.mark.skipif(NDEV > 0, reason="a GPU is visible")
def test_flag_replicas_without_a_gpu_is_the_device_error():
    with _no_device_error():
        kccl.Communicator(1, kccl.get_unique_id(), 0, device=0, config={"KCCL_GPU_FLAG_REPLICAS": 1})


@pytest.fixture(scope="module")
def l2map_selftest(tmp_path_factory):
    """The host half of gpu_l2map.cu (the calibration's analysis) in a program: tests/c/l2map_selftest.cu
    linked with the library's gpu_l2map.cu."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    root = os.path.dirname(HERE)
    exe = str(tmp_path_factory.mktemp("l2map") / "l2map_selftest")
    p = subprocess.run([nvcc, "-O2", "-std=c++17", "-I",
                        os.path.join(root, "kccl_native", "include"), "-I", os.path.join(root, "kccl_native", "src"),
                        os.path.join(HERE, "c", "l2map_selftest.cu"),
                        os.path.join(root, "kccl_native", "src", "gpu", "gpu_l2map.cu"), "-o", exe],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return exe


def test_l2map_analysis_on_made_up_latencies(l2map_selftest):
    """Two groups found (and lines near each) when they are there; refused for one L2, one SM,
    or lines all near one group."""
    p = subprocess.run([l2map_selftest], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "0 failed" in p.stdout, p.stdout + p.stderr


def test_l2map_analysis_on_the_h200_measurement(l2map_selftest, tmp_path):
    """bench/results/gpu/l2_poll.json (ld.acquire.sys, 132 SMs x 64 addresses, H200) as the
    calibration would see it: the same two groups of 66, every line near one of them."""
    import json
    d = json.load(open(os.path.join(os.path.dirname(HERE), "bench", "results", "gpu", "l2_poll.json")))
    mode = d["modes"]["acquire"]
    chain, cands, sm_map = 16, 1024, 256
    ghz = d["clock_khz"] / 1e6
    cyc = np.full((sm_map, cands), 0xffff, np.uint16)
    for sm in mode["sm"]:
        ns = np.array(sm["ns"])
        cyc[sm["smid"]] = np.round(ns[np.arange(cands) % len(ns)] * ghz * chain).astype(np.uint16)
    path = tmp_path / "cyc.bin"
    cyc.tofile(path)
    p = subprocess.run([l2map_selftest, str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    head, groups, why = p.stdout.splitlines()[:3]
    code, g0, g1, n0, n1 = map(int, head.split())
    assert (code, g0, g1) == (1, 66, 66), why
    assert n0 + n1 == cands and min(n0, n1) >= 264, why
    got = [int(x) for x in groups.split()]
    want = {sm["smid"]: sm["group"] for sm in mode["sm"]}
    same = all(got[s] == want[s] for s in want)
    flipped = all(got[s] == 1 - want[s] for s in want)
    assert same or flipped, (got[:132], why)
    assert all(g == -1 for s, g in enumerate(got) if s not in want)


needs_gpu = pytest.mark.skipif(NDEV == 0 or shutil.which("mpiexec") is None, reason="needs a CUDA GPU and mpiexec")


@needs_gpu
def test_gpu_correctness_two_ranks():
    p = subprocess.run(["mpiexec", "-n", "2", "--oversubscribe", sys.executable,
                        os.path.join(HERE, "gpu", "mpi_check.py"), "--quick"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "0 failed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


@needs_gpu
def test_gpu_failures():
    p = subprocess.run([sys.executable, os.path.join(HERE, "gpu", "failures.py")], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
