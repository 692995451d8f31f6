"""cffi out-of-line API-mode builder of kccl._kccl_cffi, Python's door into
libkccl.so (run by setup.py through cffi_modules).  The C core is compiled once,
into libkccl.so (kccl/_build_lib.py); this module links it, as every native
consumer in the package does, so that a process holds one copy of KCCL however
many of them it loads."""
import os
import re
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE = os.path.join(os.path.dirname(HERE), "kccl_native")
HEADER = os.path.join(NATIVE, "include", "kccl.h")


def _cdef_from_header(path):
    """kccl.h's declarations as cffi's cdef wants them: no comments, no
    `#ifdef __cplusplus` blocks, no preprocessor lines; the array size of the
    unique id spelled out."""
    raw = open(path).read()
    text = re.sub(r"/\*.*?\*/", "", raw, flags=re.S)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    text = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
    # array sizes spelled out (cffi's cdef has no preprocessor)
    for name, value in re.findall(r"#define (KCCL_UNIQUE_ID_BYTES|KCCL_MAX_DOMAINS) (\d+)", raw):
        text = re.sub(rf"\b{name}\b", value, text)
    # Enums as plain ints in function signatures: cffi converts int arguments and
    # results several times faster than enum-typed ones, which matters on the
    # sub-microsecond path; C converts them implicitly at the call.
    text = re.sub(r"\b(kcclResult_t|kcclDataType_t|kcclRedOp_t)(?=\s+\w+\s*[,)(])", "int", text)
    return text + "\n#define KCCL_UNIQUE_ID_BYTES ...\n#define KCCL_VERSION_CODE ...\n#define KCCL_DEV_COMM_BYTES ...\n#define KCCL_MAX_DOMAINS ...\n#define KCCL_ANY_SOURCE ...\n"


ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _build_cuda  # noqa: E402  (sibling module; kccl itself is not importable before it is built)

_cuda_decision = _build_cuda.decide()
_cu_objects, _cu_libdirs, _cu_libs, _cu_macros = _build_cuda.build(ROOT, _cuda_decision)
import _build_lib  # noqa: E402

LIB = _build_lib.build(ROOT, _cu_objects, _cu_libdirs, _cu_libs, _cu_macros)

ffibuilder = FFI()
ffibuilder.cdef(_cdef_from_header(HEADER) + "const char *kccl_cuda_build_plan(void);\n")
ffibuilder.set_source(
    "kccl._kccl_cffi",
    '#include "kccl.h"\n' + _build_cuda.plan_as_c("kccl_cuda_build_plan", _cuda_decision),
    include_dirs=[os.path.relpath(os.path.join(NATIVE, "include"), ROOT)],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-fvisibility=hidden"],
    depends=[os.path.relpath(LIB, ROOT)],  # relink when the library is rebuilt
    **_build_lib.link_args(ROOT, os.path.join(ROOT, "kccl")),
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
