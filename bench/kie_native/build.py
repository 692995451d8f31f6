"""Builds KIE's benchmark extension, kie_bench_native, into bench/kie_native/_build/:

    python bench/kie_native/build.py

bench/kie_bench.py runs the same build the first time it is imported, and again when
a source here or one of the engine's it compiles changed.  nvcc compiles kie_bench.cu
and the engine's GEMV kernels (kie_engine/gpu/csrc/gemv.cu) with the flags the
engine's own build uses (kccl/_build_cuda.py's, sm_90 + PTX); the extension does not
link the engine: it works on a GpuModel's engine through its handle, and calls the
engine's C functions through the addresses kie_engine.gpu.engine gives.  Needs CUDA."""
import glob
import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "_build")
MODULE = "kie_bench_native"
CSRC = os.path.join(ROOT, "kie_engine", "gpu", "csrc")
KCCL_INCLUDE = os.path.join(ROOT, "kccl_native", "include")
FLAGS = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-gencode=arch=compute_90,code=sm_90",
         "-gencode=arch=compute_90,code=compute_90", "--threads", "2"]

CDEF = """
int kb_bind(const char *name, uintptr_t fn);
const char *kb_last_error(void);
int kb_bench_gemv(void *engine, int rows, int cols, int iters, double *us_per_call);
int kb_bench_layer_gemvs(void *engine, int iters, double *us_per_layer);
int kb_bench_steps(void *engine, int iters, int mode, double *us_per_step);
int kb_mono_marks(void *engine, uint64_t *out, size_t n);
int kb_graph_marks(void *engine, uint64_t *out, size_t n);
"""
# The engine's functions kb_bind takes.
FUNCTIONS = ["kie_decode", "kie_sync", "kie_last_error"]


def _kccl_bench_build():
    """bench/native/build.py, for its stamp and load helpers (loaded under its own name:
    both builders are files called build.py)."""
    spec = importlib.util.spec_from_file_location("kccl_bench_build",
                                                  os.path.join(os.path.dirname(HERE), "native", "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_kb = _kccl_bench_build()
_stamp = _kb._stamp


def _inputs():
    return sorted([os.path.join(HERE, "kie_bench.cu"), os.path.abspath(__file__), os.path.join(CSRC, "gemv.cu")]
                  + glob.glob(os.path.join(CSRC, "*.h")) + glob.glob(os.path.join(CSRC, "*.cuh"))
                  + [f for f in glob.glob(os.path.join(KCCL_INCLUDE, "**", "*"), recursive=True) if os.path.isfile(f)])


def build(verbose=False):
    """Compiles the extension into OUT; returns the stamp written."""
    os.makedirs(OUT, exist_ok=True)
    from kccl import _build_cuda  # KCCL's nvcc and CUDA library search, as every native build here uses
    nvcc = _build_cuda.find_nvcc()
    if nvcc is None:
        raise SystemExit("kie_bench: nvcc is not on PATH, $CUDA_HOME/bin or /usr/local/cuda/bin")
    objects = []
    # An object is reused while its own stamp (nvcc's version and flags, the sources and
    # headers) holds: it does not depend on the Python version, so objects compiled on
    # another machine with the same nvcc can be carried to skip nvcc.
    obj_stamp = hashlib.sha256((_build_cuda._nvcc_version(nvcc) + " " + " ".join(FLAGS)).encode())
    for f in _inputs():
        obj_stamp.update(os.path.basename(f).encode() + b"\0" + open(f, "rb").read())
    obj_stamp = obj_stamp.hexdigest()
    for src in (os.path.join(HERE, "kie_bench.cu"), os.path.join(CSRC, "gemv.cu")):
        obj = os.path.join(OUT, os.path.basename(src)[:-3] + ".o")
        objects.append(obj)
        try:
            if open(obj + ".stamp").read().strip() == obj_stamp and os.path.exists(obj):
                continue
        except OSError:
            pass
        cmd = [nvcc, *FLAGS, "-I", CSRC, "-I", KCCL_INCLUDE, "-c", src, "-o", obj]
        print("kie_bench: " + " ".join(cmd), file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"kie_bench: nvcc failed\n{proc.stdout}{proc.stderr}")
        with open(obj + ".stamp", "w") as fh:
            fh.write(obj_stamp + "\n")
    ffi = FFI()
    ffi.cdef(CDEF)
    # the prototypes too: called undeclared, kb_last_error's pointer would be cut to an int
    ffi.set_source(MODULE, "#include <stddef.h>\n#include <stdint.h>\n" + CDEF, extra_objects=objects,
                   library_dirs=[_build_cuda.cuda_libdir(nvcc)], libraries=["cudart_static", "dl", "stdc++", "rt", "pthread"])
    ffi.compile(tmpdir=OUT, verbose=verbose)
    stamp = _stamp(" ".join(FLAGS), _inputs())
    with open(os.path.join(OUT, "stamp"), "w") as f:
        f.write(stamp + "\n")
    return stamp


def load():
    """The extension module, built first when missing or out of date (one process of a
    job builds, the others wait on the lock)."""
    return _kb.load_or_build(OUT, MODULE, _stamp(" ".join(FLAGS), _inputs()), build)


if __name__ == "__main__":
    print(f"kie_bench: built {MODULE} in {OUT} (stamp {build(verbose='-v' in sys.argv)[:12]})")
