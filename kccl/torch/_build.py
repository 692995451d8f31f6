"""Builds the C++ c10d backend (kccl/torch/csrc) with torch's C++-extension machinery and
imports it.  It links libkccl.so, the package's (kccl.paths.LIB), which kccl's own module
links too: one copy of KCCL in the process.  A build is named for a fingerprint of the
sources, kccl.h, the torch, the Python version and where it finds libkccl.so at run time,
so an edit, another torch or another install of kccl is a different build and an
unchanged one imports at once.  Where a build is looked for, in order:

  1. the package (kccl/torch/_prebuilt/): made when the package is built (setup.py's
     build_ext, i.e. `pip install` or `setup.py build_ext --inplace`, where torch is
     installed then) or by `python -m kccl.torch --build`.  It finds libkccl.so relative
     to itself ($ORIGIN/../../lib), as the package's folders keep their places when
     installed (a wheel built in a temporary folder included);
  2. the cache folder (KCCL_TORCH_CACHE, default ~/.cache/kccl/torch-ext), where the first
     import builds it when neither has one (a progress line says so; ranks that import
     together build once, behind a lock).  It finds libkccl.so by its absolute path, so
     each install of kccl has its own build there.

This file also runs as a script, for setup.py: `python kccl/torch/_build.py --out DIR`
builds into DIR with the interpreter's torch, importing nothing of kccl (which may not
be importable in the middle of its own build)."""
import argparse
import contextlib
import functools
import glob
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
PREBUILT = os.path.join(HERE, "_prebuilt")
FLAGS = ["-O2", "-g0", "-Wall", "-Wno-unused-function"]


@functools.lru_cache(maxsize=None)
def lib_dir():
    """kccl.paths.LIB, read from kccl/paths.py without importing kccl (this file also runs
    in the middle of kccl's build, before the package can be imported)."""
    return _import("_kccl_paths", os.path.join(os.path.dirname(HERE), "paths.py")).LIB


def run_path(folder):
    """Where a build in `folder` finds libkccl.so at run time: the package's own folder
    relative to itself, a cache folder by the absolute path."""
    if os.path.abspath(folder) == PREBUILT:
        return "$ORIGIN/" + os.path.relpath(lib_dir(), PREBUILT)
    return lib_dir()


def include_dir():
    """kccl.h: the package's copy (made by the build), else the source tree's."""
    pkg = os.path.dirname(HERE)
    for d in (os.path.join(pkg, "include"), os.path.join(os.path.dirname(pkg), "kccl_native", "include")):
        if os.path.exists(os.path.join(d, "kccl.h")):
            return d
    raise ImportError("kccl.torch: kccl.h not found (reinstall kccl: pip install -e .)")


def cache_root():
    root = os.environ.get("KCCL_TORCH_CACHE")
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kccl", "torch-ext")


def sources():
    return sorted(glob.glob(os.path.join(CSRC, "*.cpp")))


def module_name(include, folder):
    """kccl_torch_<fingerprint of the sources, kccl.h, the flags, torch, Python and the run
    path to libkccl.so of a build in `folder`>."""
    import torch
    h = hashlib.sha256(torch.__version__.encode() + sys.version.encode() + " ".join(FLAGS).encode()
                       + run_path(folder).encode())
    for f in sorted(glob.glob(os.path.join(CSRC, "*"))) + [os.path.join(include, "kccl.h")]:
        h.update(os.path.basename(f).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return "kccl_torch_" + h.hexdigest()[:16]


def _file(folder, name):
    return os.path.join(folder, name + sysconfig.get_config_var("EXT_SUFFIX"))


def _import(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_into(folder, name, include, verbose=False):
    """Compiles the extension `name`, linked against libkccl.so, into folder (atomically: a
    reader sees the whole file or none) and returns its path.  Uses ninja for parallel
    compiles when it is there; plain setuptools otherwise.  The compiler's output goes to
    folder/build.log (and to stderr when verbose); a failure raises ImportError with its end."""
    from setuptools import Distribution
    from torch.utils import cpp_extension
    os.makedirs(folder, exist_ok=True)
    lib = lib_dir()
    if not os.path.exists(os.path.join(lib, "libkccl.so")):
        raise ImportError(f"kccl.torch: {lib}/libkccl.so is missing (reinstall kccl: pip install -e .)")
    ninja = shutil.which("ninja") is not None
    ext = cpp_extension.CppExtension(name, sources(), include_dirs=[include, CSRC], extra_compile_args=FLAGS,
                                     library_dirs=[lib], libraries=["kccl"],
                                     extra_link_args=[f"-Wl,-rpath,{run_path(folder)}"])
    log_path = os.path.join(folder, "build.log")
    with tempfile.TemporaryDirectory(prefix=name + "-", dir=folder) as tmp, open(log_path, "w") as log:
        dist = Distribution({"name": name, "ext_modules": [ext], "script_args": [],
                             "cmdclass": {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=ninja)}})
        cmd = dist.get_command_obj("build_ext")
        cmd.build_lib, cmd.build_temp, cmd.inplace = tmp, os.path.join(tmp, "obj"), False
        if not ninja:
            cmd.parallel = os.cpu_count() or 1
        try:
            with contextlib.ExitStack() as quiet:
                if not verbose:
                    quiet.enter_context(_fds_to(log))
                dist.run_command("build_ext")
        except Exception as e:
            log.flush()
            with open(log_path) as fh:
                tail = fh.read()[-3000:]
            raise ImportError(f"kccl.torch: building the c10d backend failed ({e}); {log_path} ends:\n{tail}") from e
        final = _file(folder, name)
        os.replace(_file(tmp, name), final)
    return final


@contextlib.contextmanager
def _fds_to(fh):
    """stdout and stderr, Python's and the compiler processes', into the file fh."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(fh.fileno(), 1)
    os.dup2(fh.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


@contextlib.contextmanager
def _locked(path):
    import fcntl
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def load(verbose=False):
    """The extension module: a build for these sources and this torch from the package or
    the cache, else built into the cache now."""
    import torch  # noqa: F401  (the extension links against the loaded torch)
    include = include_dir()
    name = module_name(include, PREBUILT)
    path = _file(PREBUILT, name)
    if not os.path.exists(path):
        name = module_name(include, cache_root())
        folder = os.path.join(cache_root(), name)
        path = _file(folder, name)
        os.makedirs(folder, exist_ok=True)
        with _locked(folder + ".lock"):
            if not os.path.exists(path):  # a rank that held the lock may have built it meanwhile
                print(f"kccl.torch: building the c10d backend (first import, ~1-4 min) in {folder} ...",
                      file=sys.stderr, flush=True)
                t0 = time.monotonic()
                compile_into(folder, name, include, verbose)
                print(f"kccl.torch: built in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return _import(name, path)


def build_prebuilt(folder=PREBUILT, verbose=False):
    """Builds into the package's folder (or `folder`) unless it has this build; the path."""
    include = include_dir()
    name = module_name(include, folder)
    path = _file(folder, name)
    if not os.path.exists(path):
        for old in glob.glob(os.path.join(folder, "kccl_torch_*")):  # builds of other sources or torches
            os.remove(old)
        path = compile_into(folder, name, include, verbose)
    return path


NO_TORCH = 3  # main()'s exit status when this interpreter has no torch


def main(argv=None):
    ap = argparse.ArgumentParser(description="build kccl.torch's c10d backend into a folder")
    ap.add_argument("--out", default=PREBUILT)
    args = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"kccl.torch: no torch here ({e}): the c10d backend is left to the first `import kccl.torch`",
              file=sys.stderr, flush=True)
        return NO_TORCH
    print(f"kccl.torch: building the c10d backend against torch {torch.__version__} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    path = build_prebuilt(args.out)
    print(f"kccl.torch: c10d backend {path} ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
