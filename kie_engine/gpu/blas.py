"""Finding cuBLAS for the GPU engine's batched prefill.

The engine does not link cuBLAS (csrc/blas.cu loads it at run time), so that it
builds and imports wherever the CUDA runtime does.  cuBLAS usually sits in the
Python environment (the nvidia-cublas wheels PyTorch depends on) or in the CUDA
toolkit; load() tries those places in turn, then the loader's own search path,
and remembers the outcome for the process."""
import ctypes
import glob
import importlib.util
import os

_state = {}


def candidates():
    """Paths of libcublas.so.* to try, most specific first."""
    found = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        # nvidia-cublas-cu12 keeps it in nvidia/cublas/lib, the CUDA 13 wheels in nvidia/cu13/lib
        found += sorted(glob.glob(os.path.join(root, "*", "lib", "libcublas.so.*")), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            for sub in ("lib64", os.path.join("targets", "x86_64-linux", "lib"), "lib"):
                found += sorted(glob.glob(os.path.join(home, sub, "libcublas.so.*")), reverse=True)
    return [p for i, p in enumerate(found) if p not in found[:i] and "Lt" not in os.path.basename(p)]


def load(lib, ffi):
    """(True, path) once cuBLAS is loaded into the engine's module, else (False, why)."""
    if "result" in _state:
        return _state["result"]
    why = []
    for path in candidates() + [""]:
        if path:
            # what it may need from beside it (libcublasLt, a CUDA runtime of its version) must be
            # found by the loader, which does not look there: load them first, by path
            for pattern in ("libcudart.so.*", "libcublasLt.so.*"):
                for dep in sorted(glob.glob(os.path.join(os.path.dirname(path), pattern)), reverse=True):
                    try:
                        ctypes.CDLL(dep, mode=ctypes.RTLD_GLOBAL)
                        break
                    except OSError:
                        continue
        if lib.kie_blas_load(path.encode() if path else ffi.NULL) == 0:
            _state["result"] = (True, ffi.string(lib.kie_blas_path()).decode())
            return _state["result"]
        why.append(ffi.string(lib.kie_last_error()).decode(errors="replace"))
    _state["result"] = (False, why[-1] if why else "no libcublas.so found")
    return _state["result"]
