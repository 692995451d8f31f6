"""cffi out-of-line API-mode builder: compiles kccl_native/src/*.c into the
extension module kccl._kccl_cffi (run by setup.py through cffi_modules)."""
import glob
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
_build_lib.build(ROOT, _cu_objects, _cu_libdirs, _cu_libs, _cu_macros)

ffibuilder = FFI()
ffibuilder.cdef(_cdef_from_header(HEADER) + "const char *kccl_cuda_build_plan(void);\n")
ffibuilder.set_source(
    "kccl._kccl_cffi",
    '#include "kccl.h"\n' + _build_cuda.plan_as_c("kccl_cuda_build_plan", _cuda_decision),
    sources=sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(NATIVE, "src", "*.c"))),
    include_dirs=[os.path.relpath(os.path.join(NATIVE, "include"), ROOT)],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-fvisibility=hidden"],
    define_macros=_cu_macros,
    extra_objects=_cu_objects,
    depends=_cu_objects,  # relink when an object changes (build_ext compares only sources and depends)
    library_dirs=_cu_libdirs,
    libraries=["rt", "pthread"] + _cu_libs,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
