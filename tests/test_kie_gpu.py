"""KIE's GPU engine where there is no GPU (CI): the module is built where asked (KCCL_CUDA=1,
as CI does wherever nvcc is) or where a GPU driver and nvcc are, asking for the GPU fails clearly and early, and the numpy reference the GPU
checks use (a bf16 KV cache) behaves.  The engine's own correctness is checked on
the GPU machines by tests/gpu/kie_check.py (bench/RESULTS.md records the runs)."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import kccl
from kie_engine.formats.config import preset
from kie_engine.errors import GpuError, GpuUnavailableError, KieError
from kie_engine.gpu import engine as gpu_engine
from kie_engine.formats.init import random_tensors
from kie_engine.reference.model import Model, round_bf16
from kie_engine.formats.safetensors_io import float32_to_bf16_bits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = gpu_engine.device_count() == 0


def test_engine_is_built_where_it_can_run_or_when_asked():
    """KCCL_CUDA=1 builds it; auto only where nvcc AND a GPU driver are (kccl/_build_cuda.py),
    as the build saw them: the module records KCCL_CUDA, nvcc and the driver of its build."""
    plan = gpu_engine.cuda_build_plan()
    expect = plan["mode"] == "1" or (plan["mode"] == "auto" and plan["nvcc"] is not None and
                                     plan["driver"] is not None)
    assert plan["build"] == expect and gpu_engine.gpu_built() == expect, plan


def test_the_build_rule_check_ignores_the_environment_of_the_test():
    """The check above read KCCL_CUDA when the test ran, so a user who built with KCCL_CUDA=1
    and ran pytest without it saw it fail: run it with the opposite setting."""
    test = os.path.abspath(__file__) + "::test_engine_is_built_where_it_can_run_or_when_asked"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                       env=dict(os.environ, KCCL_CUDA="0" if gpu_engine.gpu_built() else "1"), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]


def test_header_constants_reach_python():
    lib = gpu_engine.lib
    assert (lib.KIE_MODE_ADVANCE, lib.KIE_MODE_GREEDY, lib.KIE_MODE_SAMPLE) == (0, 1, 2)
    assert (gpu_engine.MODE_ADVANCE, gpu_engine.MODE_GREEDY, gpu_engine.MODE_SAMPLE) == (0, 1, 2)
    assert lib.KIE_MAX_ADDS == 8 and lib.KIE_RING > 2 * gpu_engine.AHEAD


@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible")
def test_gpu_model_without_a_gpu_is_a_clear_error():
    with pytest.raises(GpuUnavailableError, match="no CUDA device|without CUDA") as e:
        gpu_engine.GpuModel(preset("tiny"))
    assert isinstance(e.value, KieError) and isinstance(e.value, RuntimeError)


@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible")
def test_cli_device_cuda_without_a_gpu_fails_before_printing(tmp_path):
    model = str(tmp_path / "tiny")
    subprocess.run([sys.executable, "-m", "kie_engine", "init", "--config", "tiny", "--out", model], check=True,
                   capture_output=True, cwd=ROOT)
    p = subprocess.run([sys.executable, "-m", "kie_engine", "generate", "--model", model, "--prompt", "hello",
                        "--device", "cuda"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2
    assert p.stdout == ""  # nothing echoed before the error
    assert "error:" in p.stderr and ("no CUDA device" in p.stderr or "without CUDA" in p.stderr)


def test_round_bf16_matches_the_checkpoint_rounding():
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 37
    got = round_bf16(x)
    want = (float32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(got, want)
    assert np.all(np.abs(got - x) <= np.abs(x) * 2.0 ** -8)
    assert not np.array_equal(got, x)


class _Dict:
    def __init__(self, cfg, tensors):
        self.config, self.t = cfg, tensors

    def tensor(self, name, rows=None, cols=None):
        a = self.t[name]
        if rows is not None:
            a = a[rows]
        if cols is not None:
            a = a[:, cols]
        return np.ascontiguousarray(a, np.float32)


def test_bf16_kv_cache_reference_is_close_to_float32_and_not_equal():
    from kie_engine.reference.model import load_weights
    cfg = preset("tiny")
    ck = _Dict(cfg, random_tensors(cfg, seed=3))
    a = Model(cfg, load_weights(ck), max_seq=64)
    b = Model(cfg, load_weights(ck), max_seq=64, kv_bf16=True)
    ids = [256, 10, 20, 30, 40]
    la, lb = a.prefill(ids), b.prefill(ids)
    rel = np.linalg.norm(la - lb) / np.linalg.norm(la)
    assert 0 < rel < 1e-2
    assert np.array_equal(b.k_cache, round_bf16(b.k_cache))  # every cached key is a bf16 value


def test_kccl_stream_split_phase_on_a_host_communicator(comm1):
    """kcclAllReduceStartStream / WaitStream: a host communicator takes stream = NULL and
    behaves as the host split phase; a stream is refused."""
    from kccl._native import ffi, lib
    comm = comm1._comm
    req = ffi.new("uint64_t *")
    x = np.arange(6, dtype=np.float32)
    y = np.zeros(6, np.float32)
    px, py = ffi.from_buffer(x), ffi.from_buffer(y)
    assert lib.kcclAllReduceStartStream(px, py, 6, lib.kcclFloat32, 0, comm, ffi.cast("void *", 1), req) == \
        lib.kcclInvalidArgument
    assert lib.kcclAllReduceStartStream(px, py, 6, lib.kcclFloat32, 0, comm, ffi.NULL, ffi.NULL) == \
        lib.kcclInvalidArgument
    assert lib.kcclAllReduceStartStream(px, py, 6, lib.kcclFloat32, 0, comm, ffi.NULL, req) == 0
    assert lib.kcclAllReduceWaitStream(comm, req[0], ffi.cast("void *", 1)) == lib.kcclInvalidArgument
    assert lib.kcclAllReduceWaitStream(comm, req[0], ffi.NULL) == 0
    assert np.array_equal(y, x)
    assert lib.kcclAllReduceWaitStream(comm, 999, ffi.NULL) == lib.kcclInvalidArgument
    h = comm1.all_reduce_start(x.copy())  # the Python form keeps the host handle for host communicators
    assert isinstance(h, kccl.AllReduceHandle) and np.array_equal(h.wait(), x)
    with pytest.raises(kccl.KcclInvalidArgument, match="stream="):
        comm1.all_reduce_start(x.copy(), stream=1)


def test_the_engine_takes_the_communicators_handle(comm1):
    """The engine gets the communicator's kcclComm_t (it links the libkccl.so the kccl
    package loaded: tests/test_c_library.py checks that), and the shape fields that size
    the monokernel's grid."""
    from kccl import capi
    ffi = gpu_engine.ffi
    assert int(ffi.cast("uintptr_t", gpu_engine._kccl_handle(comm1))) == capi.handle(comm1)
    s = ffi.new("kie_shape *")
    assert s.lanes_per_device == 0 and s.mono_blocks == 0  # 0: a lane alone on its GPU, every SM
    i = ffi.new("kie_info *")
    assert i.mono_blocks == 0 and i.mono_reducers == 0


def test_every_wrapper_call_reaches_the_engine_with_the_right_types():
    """Each GpuModel method's cffi call, against a NULL engine: the C side must answer
    with a typed error (so the argument conversions are right), never a TypeError."""
    from kie_engine.errors import GpuError
    from kie_engine.generate import Sampling
    from kie_engine.lanes.plan import lane_plan
    cfg = preset("tiny")
    m = gpu_engine.GpuModel.__new__(gpu_engine.GpuModel)
    m.cfg, m.lane, m.size, m.rank, m.max_seq, m.pos = cfg, lane_plan(cfg, 0, 1), 1, 0, 64, 0
    m.source = None  # what __init__ sets before any checkpoint is read
    m._e = gpu_engine.ffi.NULL
    m._logits = np.empty(cfg.vocab_size, np.float32)
    lib = gpu_engine.lib
    calls = [lambda: m.prefill([1, 2, 3]), lambda: m.decode_step(5), lambda: m.reset(), lambda: m.info(),
             lambda: m.generate([1, 2], 3), lambda: m.generate([1, 2], 3, Sampling(temperature=0.5, top_k=3)),
             lambda: m.upload_matrix(lib.KIE_W_EMBED, 0, np.zeros((cfg.vocab_size, cfg.hidden_size), np.float32)),
             lambda: m.upload_vector(lib.KIE_F_FINAL_NORM, 0, np.ones(cfg.hidden_size)), lambda: m._read_logits(),
             lambda: m.set_sampling(Sampling(temperature=0.5))]
    for call in calls:
        with pytest.raises(GpuError):
            call()
    m._e = None
    with pytest.raises(GpuError, match="closed"):
        m.prefill([1])


def test_native_functions_for_the_benchmarks():
    """bench/kie_native calls the engine through these (the benchmarks live outside it)."""
    from kie_engine.errors import GpuArgumentError
    assert gpu_engine.native_function("kie_decode") > 0 and gpu_engine.native_function("kie_sync") > 0
    for bad in ("kie_nope", "printf", 3):
        with pytest.raises(GpuArgumentError):
            gpu_engine.native_function(bad)
    m = gpu_engine.GpuModel.__new__(gpu_engine.GpuModel)
    m._e = None
    with pytest.raises(GpuError, match="closed"):
        m.native_handle()


def test_bad_tuning_variables_are_refused(monkeypatch):
    from kie_engine import settings
    from kie_engine.errors import GpuArgumentError
    monkeypatch.setenv("KIE_GPU_GEMV_U", "eight")
    with pytest.raises(GpuArgumentError, match="KIE_GPU_GEMV_U"):
        settings.value("KIE_GPU_GEMV_U")
    monkeypatch.setenv("KIE_GPU_GEMV_U", "9")
    with pytest.raises(GpuArgumentError, match="one of 0, 4, 8"):
        settings.value("KIE_GPU_GEMV_U")
    monkeypatch.setenv("KIE_GPU_PDL", "yes")
    with pytest.raises(GpuArgumentError, match="expected 0 or 1"):
        settings.value("KIE_GPU_PDL", default=1)
    monkeypatch.setenv("KIE_GPU_PDL", "0")
    assert settings.value("KIE_GPU_PDL", default=1) == 0


def test_every_gpu_setting_is_a_field_of_the_engines_shape():
    """The C engine reads no environment: each KIE_GPU_* setting reaches it as a kie_shape
    field of the same name (the kernel as its KIE_KERNEL_* code)."""
    from kie_engine import settings
    fields = {name for name, _t in gpu_engine.ffi.typeof("kie_shape").fields} if gpu_engine.ffi else None
    csrc = os.path.join(os.path.dirname(gpu_engine.__file__), "csrc")
    header = open(os.path.join(csrc, "kie_gpu.h")).read()
    shape = header[header.index("typedef struct {\n  int hidden"):header.index("} kie_shape;")]
    names = {s.name[len("KIE_GPU_"):].lower() for s in settings.SETTINGS if s.name.startswith("KIE_GPU_")}
    assert names <= set(re.findall(r"\b(\w+);", shape)), names - set(re.findall(r"\b(\w+);", shape))
    assert fields is None or names <= fields
    for f in os.listdir(csrc):
        assert "getenv" not in open(os.path.join(csrc, f), errors="replace").read(), f


def test_kernel_names_map_to_the_header_and_others_are_refused():
    from kie_engine.errors import GpuArgumentError
    if gpu_engine.lib is not None:
        assert gpu_engine.kernel_code("graph") == gpu_engine.lib.KIE_KERNEL_GRAPH == 0
        assert gpu_engine.kernel_code("mono") == gpu_engine.lib.KIE_KERNEL_MONO == 1
    with pytest.raises(GpuArgumentError, match="graph, mono"):
        gpu_engine.kernel_code("fused")


def test_cli_kernel_mono_needs_the_gpu_device(tmp_path):
    model = str(tmp_path / "tiny")
    subprocess.run([sys.executable, "-m", "kie_engine", "init", "--config", "tiny", "--out", model], check=True,
                   capture_output=True, cwd=ROOT)
    base = [sys.executable, "-m", "kie_engine", "generate", "--model", model, "--prompt", "hi", "--kernel", "mono"]
    p = subprocess.run(base, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stdout == "" and "--device cuda" in p.stderr


@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible")
def test_cli_kernel_mono_takes_several_ranks(tmp_path):
    """The monokernel sums the lanes itself: two ranks are not refused; here they stop at the
    missing GPU, before any rank connects."""
    model = str(tmp_path / "tiny")
    subprocess.run([sys.executable, "-m", "kie_engine", "init", "--config", "tiny", "--out", model], check=True,
                   capture_output=True, cwd=ROOT)
    env = dict(os.environ, PMI_SIZE="2", PMI_RANK="0")  # what mpiexec -n 2 tells a rank
    p = subprocess.run([sys.executable, "-m", "kie_engine", "generate", "--model", model, "--prompt", "hi",
                        "--kernel", "mono", "--device", "cuda"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert p.returncode == 2 and p.stdout == ""
    assert ("no CUDA device" in p.stderr or "without CUDA" in p.stderr) and "one lane" not in p.stderr
