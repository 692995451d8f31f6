"""cffi builder of kie_engine.gpu._kie_gpu_cffi: the engine's CUDA sources
(csrc/*.cu) compiled with nvcc where KCCL's rule says so (KCCL_CUDA: nvcc and a GPU
driver, or asked for; kccl/_build_cuda.py), linked against libkccl.so (the copy of
KCCL the Python package loads, so the lanes' communicator is the engine's); else
csrc/none.c, whose entries report a build without CUDA."""
import glob
import os
import re
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CSRC = os.path.join(HERE, "csrc")
HEADER = os.path.join(CSRC, "kie_gpu.h")
sys.path.insert(0, os.path.join(ROOT, "kccl"))
import _build_cuda  # noqa: E402  (KCCL's nvcc helpers: the same switch and flags)
import _build_lib  # noqa: E402  (how a module links libkccl.so)

KCCL_INCLUDE = os.path.join(ROOT, "kccl_native", "include")


def cdef_from_header(path):
    """kie_gpu.h as cffi's cdef wants it: no comments, no preprocessor or C++ guards;
    the #defines become `#define NAME ...` (cffi reads the values from the header);
    kccl.h's communicator handle, which it takes, first."""
    raw = open(path).read()
    text = re.sub(r"/\*.*?\*/", "", raw, flags=re.S)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    names = re.findall(r"^#define (KIE_\w+) ", text, flags=re.M)
    body = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
    return _build_lib.handle_cdef(ROOT) + body + "\n" + "\n".join(f"#define {n} ..." for n in names) + "\n"


DECISION = _build_cuda.decide("the CUDA engine")


def _sources():
    nvcc = DECISION["nvcc"] if DECISION["build"] else None
    print(f"kie_engine.gpu: {DECISION['why']}", file=sys.stderr)
    if nvcc is None:
        return [os.path.relpath(os.path.join(CSRC, "none.c"), ROOT)], [], {}
    cu = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
    # The monokernel sums the lanes through KCCL's device API (kccl_device.cuh and what it
    # includes): those headers are dependencies too, so that a change there rebuilds it.
    deps = (glob.glob(os.path.join(CSRC, "*.h")) + glob.glob(os.path.join(CSRC, "*.cuh"))
            + [f for f in glob.glob(os.path.join(KCCL_INCLUDE, "**", "*"), recursive=True) if os.path.isfile(f)])
    objects = _build_cuda.compile_cuda(ROOT, nvcc, cu, [CSRC, KCCL_INCLUDE], deps,
                                       os.path.join(ROOT, "build", "kie_cuda"), label="kie_engine.gpu")
    link = _build_lib.link_args(ROOT, HERE)
    link["library_dirs"].append(_build_cuda.cuda_libdir(nvcc))
    link["libraries"] += ["cudart_static", "dl", "stdc++", "rt", "pthread"]
    return [], objects, link


_c_sources, _objects, _link = _sources()

ffibuilder = FFI()
ffibuilder.cdef(cdef_from_header(HEADER) + "const char *kie_cuda_build_plan(void);\n")
ffibuilder.set_source(
    "kie_engine.gpu._kie_gpu_cffi",
    '#include "kie_gpu.h"\n' + _build_cuda.plan_as_c("kie_cuda_build_plan", DECISION),
    sources=_c_sources,
    include_dirs=[os.path.relpath(CSRC, ROOT), os.path.relpath(KCCL_INCLUDE, ROOT)],
    extra_compile_args=["-O2", "-std=gnu11"],
    extra_objects=_objects,
    depends=_objects,  # relink when an object changes (build_ext compares only sources and depends)
    **_link,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
