"""Benchmarks and the monokernel's profile of a KIE GpuModel, for bench/decode_gpu.py:
none of this is part of kie_engine.  Each function calls the extension of
bench/kie_native (built on first import), which works on the model's engine through
its handle (GpuModel.native_handle) and the engine's own C functions.

    us = kie_bench.bench_gemv(model, 8192, 2048)     # one GEMV, random matrices out of L2
    us = kie_bench.bench_layer_gemvs(model)          # layer 0's four GEMVs
    us = kie_bench.bench_steps(model, 128)           # decode steps (graph replays); model.pos advances
    kie_bench.mono_profile(model)                    # where the monokernel's last step went
    kie_bench.graph_profile(model)                   # the graph path's (an engine with step_clock=1)"""
import importlib.util
import os
import sys

import numpy as np

from kie_engine.errors import GpuArgumentError, GpuError, GpuMemoryError, GpuTimeoutError, GpuUnavailableError
from kie_engine.generate import Sampling
from kie_engine.gpu.engine import native_function

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
import step_clock  # noqa: E402  (bench/gpu/step_clock.py: the step clock's arithmetic, no GPU needed)


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
    """Where the monokernel's last step went, from every block's clocks (bench/gpu/step_clock.py's
    summarize_mono says what each figure is)."""
    info = model.info()
    n, grid = info["mono_stages"], info["mono_blocks"]
    marks = np.zeros(4 * n * grid, np.uint64)
    _check(_lib.kb_mono_marks(_engine(model), _ffi.cast("uint64_t *", _ffi.from_buffer(marks)), marks.size))
    return step_clock.summarize_mono(marks.astype(np.float64).reshape(n, 4, grid) / 1e3, model.cfg.num_hidden_layers)


CLK_MARKS, CLK_BLOCKS = 6, 1024  # kie_kernels.h's KIE_CLK_MARKS, KIE_CLK_BLOCKS


def graph_profile(model):
    """Where the graph path's last step went, from every block's clocks (an engine made
    with tuning step_clock=1): bench/gpu/step_clock.py's summarize, which says what each
    figure is."""
    n = 5 * model.cfg.num_hidden_layers + 1
    marks = np.zeros(n * CLK_MARKS * CLK_BLOCKS, np.uint64)
    _check(_lib.kb_graph_marks(_engine(model), _ffi.cast("uint64_t *", _ffi.from_buffer(marks)), marks.size))
    return step_clock.summarize(marks.astype(np.float64).reshape(n, CLK_MARKS, CLK_BLOCKS) / 1e3,
                                model.cfg.num_hidden_layers)
