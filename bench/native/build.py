"""Builds KCCL's benchmark extension, kccl_bench_native, into bench/native/_build/:

    python bench/native/build.py

bench/kccl_bench.py runs the same build the first time it is imported, and again
when a source here or a header of the installed kccl changed.  It compiles only
this folder's sources, against the headers the kccl build installed (kccl.paths);
the CUDA half (kccl_bench_gpu.cu, nvcc: about two minutes) when kccl itself was built
with CUDA and kccl's build rule says CUDA code belongs here (a GPU driver present, or
KCCL_CUDA=1: kccl/_build_cuda.plan), else kccl_bench_nogpu.c: a CPU-only run never
waits for nvcc.  The extension links the installed libkccl.so, the copy of KCCL that
Python's kccl package loads, and so works on its communicators (kccl.capi.handle)."""
import fcntl
import glob
import hashlib
import importlib
import os
import subprocess
import sys
import sysconfig
import time

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "_build")
MODULE = "kccl_bench_native"
GENCODE = ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]

# What Python calls; the rest of kccl_bench.h is shared by the two C halves only.
CDEF = """
const char *kb_last_error(void);
int kb_bench_all_reduce(const void *send, void *recv, size_t count, int dtype, int op, void *comm, int iters,
                        double *us_per_call);
int kb_dev_selftest(const void *inputs, void *outputs, size_t count, int dtype, int op, int iters, int blocks,
                    void *comm, void *stream);
int kb_bench_dev_all_reduce(void *buf, size_t count, int dtype, int iters, int blocks, void *comm,
                            double *us_per_call);
int kb_bench_dev_all_reduce_phases(void *buf, size_t count, int dtype, int iters, int blocks, void *comm,
                                   double phases[4]);
int kb_bench_residency(void *comm, int blocks, int timeout_ms, int foreign, int carveout, int out[4], int *sm_out);
int kb_bench_flag_hop(void *comm, int iters, int mode, double *us_per_hop);
int kb_dev_group_selftest(int dtype, int op, int count, int calls, int blocks, int reducers, int barrier,
                          int global_data, int cancel, int cancel_after_us, void *comm, int *out, double *ms);
"""


def _inputs():
    """(with CUDA, include directory, library directory, files the build depends on)."""
    import kccl
    import kccl.paths
    from kccl import _build_cuda
    cuda = kccl.gpu_support()[0] and _build_cuda.plan("the CUDA benchmark kernel")[0] is not None
    files = sorted(glob.glob(os.path.join(HERE, "*.[ch]")) + glob.glob(os.path.join(HERE, "*.cu"))
                   + [f for f in glob.glob(os.path.join(kccl.paths.INCLUDE, "**", "*"), recursive=True) if os.path.isfile(f)] + [os.path.abspath(__file__)])
    return cuda, kccl.paths.INCLUDE, kccl.paths.LIB, files


def _key(cuda, kccl_lib):
    """What the build depends on besides its files: CUDA or not, and the library it links
    (its folder is the extension's run path: another kccl install needs another build)."""
    return f"{cuda} {kccl_lib}"


def _stamp(cuda, files):
    h = hashlib.sha256(f"{cuda} {sys.version} {sysconfig.get_config_var('EXT_SUFFIX')}".encode())
    for f in files:
        h.update(os.path.basename(f).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def build(verbose=False):
    """Compiles the extension into OUT (nvcc first when kccl has CUDA); returns the stamp written."""
    cuda, include, kccl_lib, files = _inputs()
    os.makedirs(OUT, exist_ok=True)
    objects, libdirs, libs, c_sources = [], [], [], [os.path.join(HERE, "kccl_bench.c")]
    if cuda:
        from kccl import _build_cuda
        nvcc = _build_cuda.find_nvcc()
        if nvcc is None:
            raise SystemExit("kccl_bench: kccl was built with CUDA but nvcc is not on PATH, $CUDA_HOME/bin or "
                             "/usr/local/cuda/bin")
        obj = os.path.join(OUT, "kccl_bench_gpu.o")
        cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", *GENCODE, "--threads", "2",
               "-I", include, "-I", HERE, "-c", os.path.join(HERE, "kccl_bench_gpu.cu"), "-o", obj]
        # nvcc takes minutes, the C half seconds: the object has its own stamp, so
        # that a change elsewhere does not recompile it.
        cu_inputs = [f for f in files if f.endswith((".cu", ".h", ".cuh")) or f.startswith(include + os.sep)]
        obj_stamp = _stamp(" ".join(cmd[1:]), cu_inputs)
        obj_stamp_path = obj + ".stamp"
        if not (os.path.exists(obj) and os.path.exists(obj_stamp_path)
                and open(obj_stamp_path).read().strip() == obj_stamp):
            print("kccl_bench: compiling the CUDA benchmark kernel kccl_bench_gpu.cu with nvcc, 1 of 2 "
                  "(about two minutes)", file=sys.stderr, flush=True)
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"kccl_bench: nvcc failed\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
            print(f"kccl_bench: compiled kccl_bench_gpu.cu in {time.time() - t0:.0f} s", file=sys.stderr)
            with open(obj_stamp_path, "w") as f:
                f.write(obj_stamp + "\n")
        objects, libdirs, libs = [obj], [_build_cuda.cuda_libdir(nvcc)], ["cudart_static", "dl", "stdc++", "rt",
                                                                          "pthread"]
    else:
        c_sources.append(os.path.join(HERE, "kccl_bench_nogpu.c"))
    print(f"kccl_bench: building the benchmark extension {MODULE} (C{', 2 of 2' if cuda else ''})",
          file=sys.stderr, flush=True)
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(MODULE, '#include "kccl_bench.h"', sources=c_sources, include_dirs=[include, HERE],
                   extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-fvisibility=hidden"],
                   extra_objects=objects, library_dirs=[kccl_lib, *libdirs], libraries=["kccl", *libs],
                   extra_link_args=[f"-Wl,-rpath,{kccl_lib}"])
    ffi.compile(tmpdir=OUT, verbose=verbose)
    stamp = _stamp(_key(cuda, kccl_lib), files)
    with open(os.path.join(OUT, "stamp"), "w") as f:
        f.write(stamp + "\n")
    return stamp


def load():
    """The extension module, built first when missing or out of date.  A file lock
    lets the ranks of one job start together: one builds, the others wait for it."""
    cuda, _, kccl_lib, files = _inputs()
    return load_or_build(OUT, MODULE, _stamp(_key(cuda, kccl_lib), files), build)


def load_or_build(out, module, want, build_fn):
    """Module `module` of folder `out`, after build_fn() when out's stamp is not `want`
    (also bench/kie_native/build.py's)."""
    os.makedirs(out, exist_ok=True)
    stamp_path = os.path.join(out, "stamp")
    with open(os.path.join(out, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        have = open(stamp_path).read().strip() if os.path.exists(stamp_path) else None
        if have != want:
            build_fn()
    if out not in sys.path:
        sys.path.insert(0, out)
    return importlib.import_module(module)


if __name__ == "__main__":
    print(f"kccl_bench: built {MODULE} in {OUT} (stamp {build(verbose='-v' in sys.argv)[:12]})")
