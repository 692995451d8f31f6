"""Benchmarks and the monokernel's profile of a KIE GpuModel, for bench/decode_gpu.py:
none of this is part of kie_engine.  Each function calls the extension of
bench/kie_native (built on first import), which works on the model's engine through
its handle (GpuModel.native_handle) and the engine's own C functions.

    us = kie_bench.bench_gemv(model, 8192, 2048)     # one GEMV, random matrices out of L2
    us = kie_bench.bench_layer_gemvs(model)          # layer 0's four GEMVs
    us = kie_bench.bench_steps(model, 128)           # decode steps (graph replays); model.pos advances
    kie_bench.mono_profile(model)                    # where the monokernel's last step went"""
import importlib.util
import os

import numpy as np

from kie_engine.errors import GpuArgumentError, GpuError, GpuMemoryError, GpuTimeoutError, GpuUnavailableError
from kie_engine.generate import Sampling
from kie_engine.gpu.engine import native_function


def _load_native():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kie_native", "build.py")
    spec = importlib.util.spec_from_file_location("kie_bench_build", path)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    native = builder.load()
    for name in builder.FUNCTIONS:
        if not native.lib.kb_bind(name.encode(), native_function(name)):
            raise ImportError(f"kie_bench: the extension has no slot for {name}")
    return native


_native = _load_native()
_ffi, _lib = _native.ffi, _native.lib
# kie_gpu.h's KIE_E_* codes, as the engine's Python side maps them
_ERRORS = {1: GpuArgumentError, 3: GpuMemoryError, 6: GpuTimeoutError, 7: GpuUnavailableError}


def _check(rc):
    if rc:
        raise _ERRORS.get(rc, GpuError)(_ffi.string(_lib.kb_last_error()).decode(errors="replace"))


def _engine(model):
    return _ffi.cast("void *", model.native_handle())


def bench_gemv(model, rows, cols, iters=50):
    """us per call of one GEMV of a rows x cols bf16 matrix, rotating through enough random
    matrices that none is in L2, `iters` chained in a CUDA graph."""
    us = _ffi.new("double *")
    _check(_lib.kb_bench_gemv(_engine(model), rows, cols, iters, us))
    return float(us[0])


def bench_layer_gemvs(model, iters=50):
    """us per layer of layer 0's four GEMVs (norm + QKV, o, norm + gate/up, down), chained."""
    us = _ffi.new("double *")
    _check(_lib.kb_bench_layer_gemvs(_engine(model), iters, us))
    return float(us[0])


def bench_steps(model, iters, sampling=Sampling()):
    """us per decode step over `iters` graph replays (timed with events); the model's
    position advances by iters."""
    us = _ffi.new("double *")
    mode = model.set_sampling(sampling)
    _check(_lib.kb_bench_steps(_engine(model), iters, mode, us))
    model.pos += iters
    return float(us[0])


def mono_profile(model):
    """Where the monokernel's last step went, as block 0 saw it: for each kind of stage
    (qkv, attention, o, gate_up, down, head) the microseconds summed over the layers
    from its wait's end to its share written ("run") and from the previous stage's end
    to its wait's end ("wait"); "total": the step from the first stage's start to the
    head's end."""
    n = model.info()["mono_stages"]
    marks = np.zeros(2 * n, np.uint64)
    _check(_lib.kb_mono_marks(_engine(model), _ffi.cast("uint64_t *", _ffi.from_buffer(marks)), marks.size))
    t = marks.astype(np.int64).reshape(n, 2)
    kinds = ["qkv", "attention", "o", "gate_up", "down"] * model.cfg.num_hidden_layers + ["head"]
    out = {k: {"run": 0.0, "wait": 0.0} for k in dict.fromkeys(kinds)}
    for i, k in enumerate(kinds):
        out[k]["run"] += (t[i, 1] - t[i, 0]) / 1e3
        out[k]["wait"] += (t[i, 0] - t[i - 1, 1]) / 1e3 if i else 0.0
    out = {k: {a: round(float(b), 1) for a, b in v.items()} for k, v in out.items()}
    out["total"] = round(float(t[-1, 1] - t[0, 0]) / 1e3, 1)
    return out
