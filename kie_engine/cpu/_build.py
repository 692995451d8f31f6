"""cffi builder of kie_engine.cpu._kie_cpu_cffi: every C file of csrc/ (the block-format
kernels kq_*.c and the decode step), compiled once with the default flags: the SIMD
kernels carry their own target attributes and are picked at run time from CPUID, so
one build runs on any x86-64 (and the portable part on any CPU).  Linked against
libkccl.so, the copy of KCCL the Python package loads: the decode step sums the lanes
by calling kccl.h on the communicator Python made."""
import glob
import os
import re
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CSRC = os.path.join(HERE, "csrc")
sys.path.insert(0, os.path.join(ROOT, "kccl"))
import _build_lib  # noqa: E402  (how a module links libkccl.so)

KCCL_INCLUDE = os.path.join(ROOT, "kccl_native", "include")
# The public headers, in the order cffi reads them; kie_cpu.h (the decode step) joins
# when it exists.
HEADERS = [h for h in ("kq.h", "kie_cpu.h") if os.path.exists(os.path.join(CSRC, h))]


def cdef_from_header(path):
    """A header as cffi's cdef wants it: no comments, no preprocessor lines; each
    `#define NAME value` becomes `#define NAME ...` (cffi reads the value from C)."""
    text = re.sub(r"/\*.*?\*/", "", open(path).read(), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    names = re.findall(r"^\s*#\s*define\s+([A-Za-z_]\w*)[ \t]+\S", text, flags=re.M)
    body = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
    return body + "\n" + "\n".join(f"#define {n} ..." for n in names) + "\n"


def check_types(table_file=os.path.join(ROOT, "kie_engine", "formats", "gguf_types.py"), csrc=CSRC):
    """kq.h's type codes and kq_types.c's blocks must be kie_engine/formats/gguf_types.py's
    table (read from the file: the package is not importable while it builds)."""
    import runpy
    table = runpy.run_path(table_file)["TYPES"]
    codes = {n: int(c) for n, c in re.findall(r"^#define KQ_(\w+) (\d+)\b", open(os.path.join(csrc, "kq.h")).read(),
                                              flags=re.M)}
    blocks = {n: (s, int(e), int(b)) for n, s, e, b in re.findall(r'\{KQ_(\w+), "(\w+)", (\d+), (\d+)\}',
                                                                  open(os.path.join(csrc, "kq_types.c")).read())}
    c_side = {codes[n]: (s, e, b) for n, (s, e, b) in blocks.items() if n in codes}
    if c_side != table or len(blocks) != len(table):
        raise SystemExit(f"kie_engine.cpu: the GGUF types of csrc/kq.h and csrc/kq_types.c {sorted(c_side.items())} "
                         f"are not kie_engine/formats/gguf_types.py's {sorted(table.items())}")


check_types()
_LINK = _build_lib.link_args(ROOT, HERE)
_LINK["libraries"] += ["m", "pthread"]

ffibuilder = FFI()
ffibuilder.cdef(_build_lib.handle_cdef(ROOT) + "".join(cdef_from_header(os.path.join(CSRC, h)) for h in HEADERS))
ffibuilder.set_source(
    "kie_engine.cpu._kie_cpu_cffi",
    "".join(f'#include "{h}"\n' for h in HEADERS),
    sources=sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(CSRC, "*.c"))),
    depends=sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(CSRC, "*.h")))
    + [os.path.relpath(os.path.join(KCCL_INCLUDE, "kccl.h"), ROOT)],
    include_dirs=[os.path.relpath(CSRC, ROOT), os.path.relpath(KCCL_INCLUDE, ROOT)],
    extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-ffp-contract=off"],
    **_LINK,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
