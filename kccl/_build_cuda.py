"""Compiles kccl_native/src/gpu/*.cu with nvcc for the cffi extension.

KCCL_CUDA (build time, read by setup.py through kccl/_build_ffi.py):
  auto (default)  build the GPU transport when nvcc is found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)
  1               build it, and fail when nvcc is missing
  0               do not build it (the library then reports "built without CUDA")
A machine without a GPU still compiles the CUDA code (so compile errors fail CI);
the CUDA runtime is linked statically, so importing kccl never needs libcudart,
and without a driver kcclGetGpuSupport reports 0 devices."""
import glob
import os
import shutil
import subprocess
import sys

GENCODE = ["-gencode=arch=compute_90,code=sm_90",       # Hopper (H100 / H200) machine code
           "-gencode=arch=compute_90,code=compute_90"]  # PTX, compiled by the driver on newer GPUs


def _mode():
    mode = os.environ.get("KCCL_CUDA", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"KCCL_CUDA={mode!r}: expected auto, 0 or 1")
    return mode


def find_nvcc():
    cands = [shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands.append(os.path.join(home, "bin", "nvcc"))
    for c in cands:
        if c and os.access(c, os.X_OK):
            return os.path.realpath(c)
    return None


def _cuda_libdir(nvcc):
    # nvcc may be a wrapper script (/usr/local/bin/nvcc -> exec .../cuda-X/bin/nvcc): ask the
    # usual homes too.
    homes = [os.path.dirname(os.path.dirname(nvcc))]
    homes += [h for h in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if h]
    for home in homes:
        for sub in ("lib64", os.path.join("targets", "x86_64-linux", "lib"), "lib"):
            d = os.path.join(home, sub)
            if os.path.exists(os.path.join(d, "libcudart_static.a")):
                return d
    raise SystemExit(f"nvcc at {nvcc} but no libcudart_static.a under {', '.join(homes)}")


def _stale(obj, deps):
    if not os.path.exists(obj):
        return True
    t = os.path.getmtime(obj)
    return any(os.path.getmtime(d) > t for d in deps)


def build(root):
    """(extra_objects, library_dirs, libraries, define_macros) for set_source; empty lists without CUDA."""
    mode = _mode()
    nvcc = None if mode == "0" else find_nvcc()
    if nvcc is None:
        if mode == "1":
            raise SystemExit("KCCL_CUDA=1 but nvcc was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
        print("kccl: building without the GPU transport (%s)" % ("KCCL_CUDA=0" if mode == "0" else "no nvcc"),
              file=sys.stderr)
        return [], [], [], []
    native = os.path.join(root, "kccl_native")
    include = os.path.join(native, "include")
    sources = sorted(glob.glob(os.path.join(native, "src", "gpu", "*.cu")))
    deps_common = (glob.glob(os.path.join(include, "*")) + glob.glob(os.path.join(native, "src", "gpu", "*.h"))
                   + [os.path.join(native, "src", "gpu_api.h")])
    outdir = os.path.join(root, "build", "kccl_cuda")
    os.makedirs(outdir, exist_ok=True)
    objects = []
    for src in sources:
        obj = os.path.join(outdir, os.path.basename(src)[:-3] + ".o")
        if _stale(obj, [src] + deps_common):
            cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", *GENCODE,
                   "-I", include, "-DKCCL_HAVE_CUDA=1", "-c", src, "-o", obj]
            print("kccl: " + " ".join(cmd), file=sys.stderr)
            subprocess.check_call(cmd)
        objects.append(os.path.relpath(obj, root))
    return (objects, [_cuda_libdir(nvcc)], ["cudart_static", "dl", "stdc++"], [("KCCL_HAVE_CUDA", "1")])
