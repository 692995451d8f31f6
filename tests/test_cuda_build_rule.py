"""Where CUDA code is compiled (issue 33: a CPU-only machine with nvcc paid ~3.5 minutes of
nvcc at install and at the first benchmark): KCCL_CUDA=auto compiles only where nvcc and a
GPU driver both are, KCCL_CUDA=1 always, 0 never; the benchmark extension's CUDA half
follows the same rule."""
import os

import pytest

from kccl import _build_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("mode", ["auto", "", "AUTO", "0", "1"])
@pytest.mark.parametrize("nvcc", [None, "/opt/cuda/bin/nvcc"])
@pytest.mark.parametrize("driver", [None, "/dev/nvidiactl"])
def test_plan(monkeypatch, mode, nvcc, driver):
    monkeypatch.setenv("KCCL_CUDA", mode)
    monkeypatch.setattr(_build_cuda, "find_nvcc", lambda: nvcc)
    monkeypatch.setattr(_build_cuda, "gpu_driver", lambda: driver)
    if mode == "1" and nvcc is None:
        with pytest.raises(SystemExit, match="KCCL_CUDA=1 but nvcc was not found"):
            _build_cuda.plan()
        return
    got, why = _build_cuda.plan("the thing")
    want = nvcc if (mode == "1" or (mode.lower() in ("auto", "") and driver)) else None
    assert got == want, why
    if got is None:
        assert why.startswith("building without the thing")
    if mode.lower() in ("auto", "") and nvcc and not driver:
        assert "no GPU driver" in why and "KCCL_CUDA=1" in why  # says why, and how to get it anyway


def test_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv("KCCL_CUDA", "yes")
    with pytest.raises(SystemExit, match="expected auto, 0 or 1"):
        _build_cuda.plan()


def test_gpu_driver_finds_none_where_there_is_none():
    has = os.path.exists("/dev/nvidiactl") or any(os.path.exists(os.path.join(d, "libcuda.so.1")) for d in
                                                  ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"))
    if has:
        pytest.skip("this machine has a CUDA driver")
    assert _build_cuda.gpu_driver() is None


def test_benchmark_extension_skips_cuda_without_a_driver(monkeypatch):
    """bench/allreduce.py's first run compiled a CUDA kernel for 2 minutes on a CPU-only
    machine whenever kccl had been built with CUDA."""
    import importlib.util
    import kccl
    spec = importlib.util.spec_from_file_location("kccl_bench_native_build", os.path.join(ROOT, "bench", "native",
                                                                                         "build.py"))
    native_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native_build)
    monkeypatch.setattr(kccl, "gpu_support", lambda: (True, 0))  # a kccl built with CUDA
    monkeypatch.setattr(_build_cuda, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.delenv("KCCL_CUDA", raising=False)
    monkeypatch.setattr(_build_cuda, "gpu_driver", lambda: None)
    assert native_build._inputs()[0] is False
    monkeypatch.setattr(_build_cuda, "gpu_driver", lambda: "libcuda.so.1")
    assert native_build._inputs()[0] is True
    monkeypatch.setattr(_build_cuda, "gpu_driver", lambda: None)
    monkeypatch.setenv("KCCL_CUDA", "1")
    assert native_build._inputs()[0] is True


def _fake_nvcc(tmp_path):
    """An nvcc that says its release, records each compile's arguments and writes the object."""
    log = tmp_path / "calls.txt"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\n"
                    "if [ \"$1\" = --version ]; then echo 'Cuda compilation tools, release 13.0, V13.0.0'; exit 0; fi\n"
                    f"echo \"$@\" >> {log}\n"
                    "while [ $# -gt 1 ]; do if [ \"$1\" = -o ]; then : > \"$2\"; fi; shift; done\n")
    nvcc.chmod(0o755)
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k() {}\n")
    return str(nvcc), str(src), log


@pytest.mark.parametrize("value, lineinfo", [("0", False), ("", False), ("1", True)])
def test_lineinfo_setting(monkeypatch, tmp_path, value, lineinfo):
    """KCCL_NVCC_LINEINFO=1 adds -lineinfo, and the object's stamp tells the two builds apart."""
    nvcc, src, log = _fake_nvcc(tmp_path)
    monkeypatch.setenv("KCCL_NVCC_LINEINFO", value)
    out = tmp_path / "obj"
    _build_cuda.compile_cuda(str(tmp_path), nvcc, [src], [], [], str(out))
    assert ("-lineinfo" in log.read_text().split()) == lineinfo
    stamp = (out / "k.o.stamp").read_text()
    monkeypatch.setenv("KCCL_NVCC_LINEINFO", "0" if lineinfo else "1")
    _build_cuda.compile_cuda(str(tmp_path), nvcc, [src], [], [], str(out))
    assert (out / "k.o.stamp").read_text() != stamp
    assert len(log.read_text().splitlines()) == 2  # the other setting compiled again


def test_bad_lineinfo_is_refused(monkeypatch, tmp_path):
    nvcc, src, _ = _fake_nvcc(tmp_path)
    monkeypatch.setenv("KCCL_NVCC_LINEINFO", "yes")
    with pytest.raises(SystemExit, match="KCCL_NVCC_LINEINFO='yes': expected 0 or 1"):
        _build_cuda.compile_cuda(str(tmp_path), nvcc, [src], [], [], str(tmp_path / "obj"))
