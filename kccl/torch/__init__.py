"""torch.distributed's "kccl" backend, for CPU and CUDA tensors.

    import kccl.torch                              # registers "kccl"
    torch.distributed.init_process_group("kccl")   # or "cpu:kccl,cuda:nccl"

The backend is C++ (kccl/torch/csrc): a c10d::Backend that links libkccl.so, the one
copy of KCCL in the process (kccl's own module links it too), and calls kccl.h with no
Python on a collective's path.  It is built when the package is (pip install, where
torch is installed then), or by `python -m kccl.torch --build`; failing both, on the
first import into a cache folder (KCCL_TORCH_CACHE; a progress line says so).  The
core kccl package never needs torch; importing this subpackage does.

Each backend joins a KCCL host communicator: rank 0 puts the unique id in the c10d
store torch hands the backend, the others read it (waiting at most the group's
timeout); the first collective on CUDA tensors makes a GPU communicator beside it the
same way.  The KCCL_* settings apply as for kccl.Communicator; KCCL_TIMEOUT_MS and
KCCL_INIT_TIMEOUT_MS, when not set, are the group's timeout (init_process_group(timeout=...)).
See docs/torch.md for what each collective does and what is refused."""
import atexit
import datetime
import os

import torch.distributed as _dist

from .. import config as _config
from .. import placement as _placement
from .._native import ffi as _ffi
from . import _build

BACKEND_NAME = "kccl"
# mpiexec (MPICH / Intel MPI: PMI_*; Open MPI: OMPI_COMM_WORLD_*) says a rank's place in
# its own variables; env:// reads RANK and WORLD_SIZE only.
_LAUNCHER_VARS = (("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
                  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"))
_MAX_TIMEOUT_MS = 86_400_000  # KCCL_TIMEOUT_MS's upper bound (kccl_settings.def)

_ext = _build.load()
# A future's completion may run on the backend's completer thread and touch Python objects;
# before the interpreter finalizes (when such a thread would be ended mid-call), stop that
# and wait for what is under way (kccl/torch/csrc/host_comm.h quiesce_callbacks).
atexit.register(_ext.quiesce_callbacks, 5000)


def ranks_from_launcher(environ=None):
    """Under mpiexec: sets RANK, WORLD_SIZE (and LOCAL_RANK) from the launcher's variables
    when neither RANK nor WORLD_SIZE is set, so that init_process_group("kccl") with
    env:// works given MASTER_ADDR and MASTER_PORT.  Runs at import; returns the
    variables it set."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return {}
    for rank, size, local in _LAUNCHER_VARS:
        if rank in env and size in env:
            out = {"RANK": env[rank], "WORLD_SIZE": env[size]}
            if local in env and "LOCAL_RANK" not in env:
                out["LOCAL_RANK"] = env[local]
            env.update(out)
            return out
    return {}


def _timeout_ms(timeout):
    if timeout is None:
        return 30 * 60 * 1000
    if isinstance(timeout, datetime.timedelta):
        ms = int(timeout.total_seconds() * 1000)
    else:
        ms = int(timeout)
    return max(1, min(ms, _MAX_TIMEOUT_MS))


def _create(store, rank, size, timeout):
    """Backend.register_backend's creator: called by torch for every group this rank is in."""
    ms = _timeout_ms(timeout)
    # the group's timeout bounds its join as well as its collectives, as for torch's own backends
    overrides = {k: ms for k in ("KCCL_TIMEOUT_MS", "KCCL_INIT_TIMEOUT_MS") if k not in os.environ}
    settings = _config.resolve(overrides)
    cfg = _config.native_from(_ffi, settings)
    pl, _note = _placement.native(_ffi, size, rank, settings["KCCL_TOPO"][0], settings["KCCL_TOPO_FILE"][0])
    return _ext.create_backend(store, rank, size, ms, bytes(_ffi.buffer(cfg)), bytes(_ffi.buffer(pl)))


def _backend(group):
    import torch
    pg = group if group is not None else _dist.group.WORLD
    return pg._get_backend(torch.device("cpu"))


def async_started(group=None):
    """How many async all-reduces of `group` (default: the default group) went through
    KCCL's split phase (returned before the sum was done).  For tests and tuning."""
    return _ext.async_started(_backend(group))


def p2p_collectives(group=None):
    """How many gathers, scatters and all-to-alls of `group` went point-to-point (moving
    only the bytes each rank needs).  For tests and tuning."""
    return _ext.p2p_collectives(_backend(group))


def set_p2p_min_bytes(nbytes, group=None):
    """From how many bytes per rank gather, scatter and all_to_all of `group` go
    point-to-point on CPU tensors (every rank must set the same).  For tests and tuning."""
    _ext.set_p2p_min_bytes(_backend(group), int(nbytes))


ranks_from_launcher()
if BACKEND_NAME not in _dist.Backend.backend_list:
    _dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])

__all__ = ["BACKEND_NAME", "async_started", "p2p_collectives", "ranks_from_launcher", "set_p2p_min_bytes"]
