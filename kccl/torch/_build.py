"""Builds the C++ c10d backend (kccl/torch/csrc) with torch's C++-extension machinery
and imports it.  The build lands in a cache folder named for a hash of the sources,
kccl.h and the torch version, so an edit or another torch rebuilds and an unchanged
one imports at once; ranks that import together build once (torch's lock on the
folder).  `python -m kccl.torch --build` does it ahead of time (CI, images)."""
import glob
import hashlib
import importlib.util
import os
import sys

from .. import paths

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def _include_dir():
    """kccl.h: the package's copy (made by the build), else the source tree's."""
    for d in (paths.INCLUDE, os.path.join(os.path.dirname(paths.PREFIX), "kccl_native", "include")):
        if os.path.exists(os.path.join(d, "kccl.h")):
            return d
    raise ImportError("kccl.torch: kccl.h not found (reinstall kccl: pip install -e .)")


def _cache_root():
    root = os.environ.get("KCCL_TORCH_CACHE")
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kccl", "torch-ext")


def _sources():
    return sorted(glob.glob(os.path.join(CSRC, "*.cpp")))


def _fingerprint(include):
    import torch
    h = hashlib.sha256(torch.__version__.encode() + sys.version.encode())
    for f in sorted(glob.glob(os.path.join(CSRC, "*"))) + [os.path.join(include, "kccl.h")]:
        h.update(os.path.basename(f).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def _import_built(name, folder):
    so = os.path.join(folder, name + ".so")
    if not os.path.exists(so):
        return None
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(verbose=False):
    """The extension module, built first when the cache has none for these sources."""
    import torch  # noqa: F401  (the extension links against the loaded torch)
    include = _include_dir()
    name = "kccl_torch_" + _fingerprint(include)
    folder = os.path.join(_cache_root(), name)
    try:
        mod = _import_built(name, folder)
    except ImportError:
        mod = None  # half-written by a rank that is building it: wait for it below
    if mod is not None:
        return mod
    from torch.utils import cpp_extension
    os.makedirs(folder, exist_ok=True)
    print(f"kccl.torch: building the c10d backend (first import, ~1-2 min) in {folder} ...",
          file=sys.stderr, flush=True)
    mod = cpp_extension.load(name=name, sources=_sources(), extra_include_paths=[include, CSRC],
                             extra_cflags=["-O2", "-Wall", "-Wno-unused-function"], build_directory=folder,
                             verbose=verbose)
    print("kccl.torch: built", file=sys.stderr, flush=True)
    return mod
