"""The HIP branch of kccl_gpu_compat.h, compiled by a real hipcc for AMD GPUs: the GPU
transport's sources (kccl_native/src/gpu/*.cu) and tests/hip/compat_names.hip, which
uses every name the branch defines.  Nothing runs: there is no AMD GPU here.

hipcc: $KCCL_HIPCC (then it must work), else hipcc on PATH, else
build/hip-toolchain/bin/hipcc, where .ci/hip_toolchain unpacks Debian's (ROCm 5.2.3,
clang 15); without one the compiling tests skip.  Targets: gfx90a (MI200), and the
MI300 family's gfx942 where the compiler knows it, else gfx940 (clang 15 knows
gfx940 but not gfx942).  Objects and stamps go to build/kccl_hip, so an unchanged
source is not compiled again."""
import os
import re
import shutil
import subprocess

import pytest

from kccl._build_cuda import _digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "kccl_native")
INCLUDE = os.path.join(NATIVE, "include")
GPU_SRC = os.path.join(NATIVE, "src", "gpu")
COMPAT = os.path.join(INCLUDE, "kccl_device", "gpu_compat.h")
NAMES = os.path.join(ROOT, "tests", "hip", "compat_names.hip")
OUT = os.path.join(ROOT, "build", "kccl_hip")
SOURCES = sorted(f for f in os.listdir(GPU_SRC) if f.endswith(".cu"))
# As kccl/_build_cuda.py compiles them for CUDA.  -Wno-unused-result: HIP marks
# hipError_t [[nodiscard]], and the sources drop the result of cleanup calls on purpose.
FLAGS = ["-x", "hip", "-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wno-unused-result",
         "-DKCCL_HAVE_CUDA=1", "-I", INCLUDE]


def _branches():
    """(HIP branch, CUDA branch) of kccl_gpu_compat.h, as text: from `#ifdef KGPU_HIP` to
    the CUDA banner, and from there to the end."""
    text = open(COMPAT).read()
    start, banner = text.find("#ifdef KGPU_HIP"), text.find("- CUDA ----- */")
    assert 0 <= start < banner, "kccl_gpu_compat.h: no `#ifdef KGPU_HIP` before the CUDA banner"
    return text[start:banner], text[banner:]


def _names(text):
    return set(re.findall(r"\b(?:kgpu|KGPU_)\w*", re.sub(r"/\*.*?\*/", "", text, flags=re.S)))


def test_hip_branch_defines_every_name_of_the_cuda_branch():
    hip, cuda = _branches()
    missing = _names(cuda) - _names(hip)
    assert not missing, f"kccl_gpu_compat.h: HIP branch lacks {sorted(missing)}"


def test_compat_names_uses_every_name_of_the_hip_branch():
    unused = _names(_branches()[0]) - _names(open(NAMES).read())
    assert not unused, f"tests/hip/compat_names.hip does not use {sorted(unused)}"


def _hip_env():
    # hipcc picks NVIDIA's platform wherever it finds nvcc.
    return dict(os.environ, HIP_PLATFORM="amd")


@pytest.fixture(scope="module")
def hipcc():
    given = os.environ.get("KCCL_HIPCC")
    path = given or shutil.which("hipcc")
    local = os.path.join(ROOT, "build", "hip-toolchain", "bin", "hipcc")
    if path is None and os.access(local, os.X_OK):
        path = local
    if path is None:
        pytest.skip("no hipcc (set KCCL_HIPCC, or run .ci/hip_toolchain to unpack Debian's)")
    res = subprocess.run([path, "--version"], capture_output=True, text=True, env=_hip_env())
    if res.returncode != 0 or "clang version" not in res.stdout:
        message = f"{path} --version failed:\n{res.stdout}{res.stderr}"
        if given:
            pytest.fail(message)
        pytest.skip(message)
    return path, res.stdout.strip()


def _knows(hipcc, arch):
    res = subprocess.run([hipcc, f"--offload-arch={arch}", "-x", "hip", "-fsyntax-only", os.devnull],
                         capture_output=True, text=True, env=_hip_env())
    return res.returncode == 0


@pytest.fixture(scope="module")
def targets(hipcc):
    arches = ["gfx90a"]
    mi300 = next((a for a in ("gfx942", "gfx940") if _knows(hipcc[0], a)), None)
    if mi300:
        arches.append(mi300)
    return arches


def _compile(hipcc, targets, src, stem):
    """src to build/kccl_hip/STEM.o for every target, unless a stamp says it is there."""
    path, version = hipcc
    flags = FLAGS + [f"--offload-arch={a}" for a in targets]
    deps = [os.path.join(d, f) for d, _, fs in os.walk(INCLUDE) for f in fs]
    deps += [os.path.join(GPU_SRC, f) for f in os.listdir(GPU_SRC) if f.endswith((".h", ".cuh"))]
    deps.append(os.path.join(NATIVE, "src", "gpu_api.h"))
    os.makedirs(OUT, exist_ok=True)
    obj = os.path.join(OUT, stem + ".o")
    stamp = _digest([version, *flags, os.path.relpath(src, ROOT)], [src, *deps])
    if os.path.exists(obj) and os.path.exists(obj + ".stamp") and open(obj + ".stamp").read().strip() == stamp:
        return
    res = subprocess.run([path, *flags, "-c", src, "-o", obj], capture_output=True, text=True, env=_hip_env())
    assert res.returncode == 0, f"hipcc ({', '.join(targets)}) failed on {os.path.relpath(src, ROOT)}:\n{res.stderr}"
    with open(obj + ".stamp", "w") as fh:
        fh.write(stamp + "\n")


def test_every_name_of_the_hip_branch_compiles(hipcc, targets):
    _compile(hipcc, targets, NAMES, "compat_names")


@pytest.mark.parametrize("source", SOURCES)
def test_gpu_transport_source_compiles_for_amd(hipcc, targets, source):
    _compile(hipcc, targets, os.path.join(GPU_SRC, source), source[:-3])
