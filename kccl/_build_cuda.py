"""Compiles kccl_native/src/gpu/*.cu with nvcc for the cffi extension.

KCCL_CUDA (build time, read by setup.py through kccl/_build_ffi.py):
  auto (default)  build the GPU transport when nvcc is found (PATH, $CUDA_HOME/bin,
                  /usr/local/cuda/bin) AND a GPU driver is present (/dev/nvidiactl, or
                  libcuda.so.1 loadable): code that cannot run here is not compiled
  1               build it (a compile check on a machine without a GPU), and fail when
                  nvcc is missing
  0               do not build it (the library then reports "built without CUDA")
nvcc takes minutes per file, and a CPU-only machine that merely has the toolkit
installed paid them at every install (issue 33: 71 s against 22 s); CI asks with
KCCL_CUDA=1 wherever nvcc is, so compile errors still fail it.  The CUDA runtime is
linked statically, so importing kccl never needs libcudart, and without a driver
kcclGetGpuSupport reports 0 devices."""
import concurrent.futures
import ctypes
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time

GENCODE = ["-gencode=arch=compute_90,code=sm_90",       # Hopper (H100 / H200) machine code
           "-gencode=arch=compute_90,code=compute_90"]  # PTX, compiled by the driver on newer GPUs


def _mode():
    mode = os.environ.get("KCCL_CUDA", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"KCCL_CUDA={mode!r}: expected auto, 0 or 1")
    return mode


def gpu_driver():
    """Where a CUDA driver shows itself ("/dev/nvidiactl" or "libcuda.so.1"), else None."""
    if os.path.exists("/dev/nvidiactl"):
        return "/dev/nvidiactl"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return "libcuda.so.1"


def plan(what="the GPU transport"):
    """(nvcc, why): the nvcc to compile `what` with, or None not to; `why` says which
    rule decided, for the build's one line about it.  KCCL_CUDA=1 without nvcc fails."""
    d = decide(what)
    return d["nvcc"] if d["build"] else None, d["why"]


def decide(what="the GPU transport"):
    """plan()'s decision with what it was made from: {"mode": KCCL_CUDA, "nvcc", "driver"
    (None where not looked for or not found), "build": bool, "why"}.  The extensions
    record it (recorded_plan) so that a test can check the build against the
    environment it was built in, not the one the test runs in."""
    mode = _mode()
    d = {"mode": mode, "nvcc": None, "driver": None, "build": False}
    if mode == "0":
        return dict(d, why=f"building without {what} (KCCL_CUDA=0)")
    nvcc = d["nvcc"] = find_nvcc()
    if mode == "1":
        if nvcc is None:
            raise SystemExit("KCCL_CUDA=1 but nvcc was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
        return dict(d, build=True, why=f"building {what} (KCCL_CUDA=1, {nvcc})")
    if nvcc is None:
        return dict(d, why=f"building without {what} (no nvcc)")
    driver = d["driver"] = gpu_driver()
    if driver is None:
        return dict(d, why=(f"building without {what}: nvcc is here but no GPU driver (no /dev/nvidiactl, no "
                            f"libcuda.so.1); KCCL_CUDA=1 compiles it anyway"))
    return dict(d, build=True, why=f"building {what} ({nvcc}, GPU driver: {driver})")


def plan_as_c(name, decision):
    """C source of `const char *name(void)`, which returns the decision as JSON: compiled
    into an extension beside the code it decided on, so the two cannot disagree."""
    import json
    text = json.dumps(decision, sort_keys=True)
    return f"static const char *{name}(void) {{ return {json.dumps(text)}; }}\n"


def find_nvcc():
    cands = [shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands.append(os.path.join(home, "bin", "nvcc"))
    for c in cands:
        if c and os.access(c, os.X_OK):
            return os.path.realpath(c)
    return None


def cuda_libdir(nvcc):
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


def _nvcc_version(nvcc):
    """The release (\"release 13.0\"): objects of one release link and run alike, so a
    patch-level difference between machines need not rebuild them."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return f"release {m.group(1)}" if m else out.strip() or nvcc


def _digest(parts, files):
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() + b"\0")
    for f in sorted(files):
        h.update(os.path.basename(f).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def compile_cuda(root, nvcc, sources, include_dirs, deps, outdir, defines=(), label="kccl"):
    """Compiles each .cu source to outdir/NAME.o, all at once (one nvcc per source, and
    nvcc's own threads for the two targets): one after another they took about three
    minutes on the GPU machines.  An object is rebuilt only when a stamp beside it
    (a hash of the nvcc version, the flags and every source and header it depends on)
    differs, so objects compiled on another machine with the same nvcc can be carried
    over, whatever their file times.  Returns the objects' paths relative to root."""
    os.makedirs(outdir, exist_ok=True)
    version = _nvcc_version(nvcc)
    flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", *GENCODE, "--threads", "2"]
    flags += [f"-D{d}" for d in defines]
    lineinfo = os.environ.get("KCCL_NVCC_LINEINFO", "0").strip() or "0"
    if lineinfo not in ("0", "1"):
        raise SystemExit(f"KCCL_NVCC_LINEINFO={lineinfo!r}: expected 0 or 1")
    if lineinfo == "1":  # source lines for the sanitizers' and profilers' reports
        flags.append("-lineinfo")
    jobs, objects = [], []
    for src in sources:
        obj = os.path.join(outdir, os.path.basename(src)[:-3] + ".o")
        rel_incs = [os.path.relpath(i, root) for i in include_dirs]
        stamp = _digest([version, *flags, *rel_incs, os.path.relpath(src, root)], [src, *deps])
        stamp_path = obj + ".stamp"
        fresh = os.path.exists(obj) and os.path.exists(stamp_path) and open(stamp_path).read().strip() == stamp
        if not fresh:
            cmd = [nvcc, *flags, *[a for i in include_dirs for a in ("-I", i)], "-c", src, "-o", obj]
            jobs.append((cmd, obj, stamp_path, stamp))
        objects.append(os.path.relpath(obj, root))

    total = len(jobs)

    def run(job):
        cmd, obj, stamp_path, stamp = job
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            return f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
        with open(stamp_path, "w") as fh:
            fh.write(stamp + "\n")
        with lock:
            done[0] += 1
            print(f"{label}: compiled {os.path.basename(obj)[:-2]}.cu, {done[0]} of {total}, in "
                  f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        return None

    if jobs:
        import threading
        lock, done = threading.Lock(), [0]
        workers = max(1, min(total, os.cpu_count() or 1))
        # nvcc takes tens of seconds a file: say what is coming before the wait.
        print(f"{label}: compiling {total} CUDA file{'s' if total > 1 else ''} with nvcc, {workers} at a time "
              f"(about a minute each): " + ", ".join(os.path.basename(j[0][-3]) for j in jobs),
              file=sys.stderr, flush=True)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
            failures = [f for f in ex.map(run, jobs) if f]
        if failures:
            raise SystemExit("nvcc failed:\n" + "\n".join(failures))
    return objects


def build(root, decision=None):
    """(extra_objects, library_dirs, libraries, define_macros) for set_source; empty lists
    without CUDA.  decision: decide()'s, made now when not given."""
    decision = decision or decide()
    nvcc = decision["nvcc"] if decision["build"] else None
    print(f"kccl: {decision['why']}", file=sys.stderr)
    if nvcc is None:
        return [], [], [], []
    native = os.path.join(root, "kccl_native")
    include = os.path.join(native, "include")
    sources = sorted(glob.glob(os.path.join(native, "src", "gpu", "*.cu")))
    # Every header a .cu file may include: the installed ones, and src/gpu's own (.h, .cuh).
    deps = ([f for f in glob.glob(os.path.join(include, "**", "*"), recursive=True) if os.path.isfile(f)]
            + glob.glob(os.path.join(native, "src", "gpu", "*.h")) + glob.glob(os.path.join(native, "src", "gpu", "*.cuh"))
            + [os.path.join(native, "src", "gpu_api.h")])
    objects = compile_cuda(root, nvcc, sources, [include], deps, os.path.join(root, "build", "kccl_cuda"),
                           defines=["KCCL_HAVE_CUDA=1"])
    return (objects, [cuda_libdir(nvcc)], ["cudart_static", "dl", "stdc++"], [("KCCL_HAVE_CUDA", "1")])
