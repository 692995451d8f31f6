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
    """Where the monokernel's last step went, from every block's clocks.  For each kind of
    stage (qkv, attention, o, gate_up, down, head), microseconds summed over the layers:
      crit     the step's critical path: the stage's last block done, less the previous
               stage's (the kinds' crit add up to the step);
      wait     per block, from its previous stage's end to this stage's start (its wait
               for the stage's inputs), the mean over blocks;
      stage_x  per block, staging the input (norm or copy of x), mean;
      run      per block, from the input staged to its share written (tiles waited for and
               used), mean; spread: the last block's end less the first block's;
      lead     per block, how long before the consumers started the stage the producer
               had issued the stage's first tile (negative: issued after), mean;
    for attention stages, in place of stage_x / run / lead: scores, values and rest, thread
    0's first item from its start to its scores and softmax done, to its values done, and
    on to the block's end (the combine, further items), mean over blocks with items; and
    "total": the first stage's first start to the head's last end.  For GEMV kinds also
      run_cv_block  how much the blocks' runs differ in a way that stays with the block: the
                    spread (coefficient of variation) across blocks of each block's run
                    relative to its stage's mean, averaged over the layers;
      run_cv_noise  and in a way that does not: the spread of each block's relative run
                    across the layers, the mean over blocks.  A stage whose blocks' runs
                    differ mostly by block (an SM that streams slower every layer) could take
                    shares sized to the blocks; one whose runs differ by noise could not;
      end_sd_block  likewise for when the blocks end (us after their stage's mean end): the
      end_sd_noise  spread across blocks of each one's mean over the layers, and the mean
                    over blocks of each one's spread across the layers."""
    info = model.info()
    n, grid = info["mono_stages"], info["mono_blocks"]
    marks = np.zeros(4 * n * grid, np.uint64)
    _check(_lib.kb_mono_marks(_engine(model), _ffi.cast("uint64_t *", _ffi.from_buffer(marks)), marks.size))
    t = marks.astype(np.float64).reshape(n, 4, grid) / 1e3  # us
    start, staged, end, issued = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    has = end > 0  # blocks with a share of the stage (the others never mark it)
    kinds = ["qkv", "attention", "o", "gate_up", "down"] * model.cfg.num_hidden_layers + ["head"]
    keys = ("crit", "wait", "stage_x", "run", "spread", "lead")
    out = {k: dict.fromkeys(keys, 0.0) for k in dict.fromkeys(kinds)}
    prev_end_all = None
    prev_end = None
    for i, k in enumerate(kinds):
        h = has[i]
        if not h.any():
            continue
        last = end[i][h].max()
        o = out[k]
        o["crit"] += last - (prev_end_all if prev_end_all is not None else start[i][h].min())
        if prev_end is not None:
            hb = h & (prev_end > 0)
            if hb.any():
                o["wait"] += float(np.mean(start[i][hb] - prev_end[hb]))
        o["stage_x"] += float(np.mean(staged[i][h] - start[i][h]))
        o["run"] += float(np.mean(end[i][h] - staged[i][h]))
        o["spread"] += last - end[i][h].min()
        hi = h & (issued[i] > 0)
        if hi.any():
            o["lead"] += float(np.mean(start[i][hi] - issued[i][hi]))
        prev_end_all = last
        prev_end = np.where(h, end[i], prev_end if prev_end is not None else 0)
    # attention: thread 0's first item, split into scores + softmax, values, and the rest
    # (the combine, further items, the block's wait for its other half), over blocks with items
    att = {"scores": 0.0, "values": 0.0, "rest": 0.0}
    for i, k in enumerate(kinds):
        if k != "attention":
            continue
        hi = has[i] & (issued[i] > 0) & (staged[i] > 0)
        if hi.any():
            att["scores"] += float(np.mean(staged[i][hi] - start[i][hi]))
            att["values"] += float(np.mean(issued[i][hi] - staged[i][hi]))
            att["rest"] += float(np.mean(end[i][hi] - issued[i][hi]))
    if "attention" in out:
        out["attention"]["stage_x"] = 0.0  # its STAGED mark is the item's clock, not an input staged
        out["attention"]["run"] = out["attention"]["lead"] = 0.0
        out["attention"].update(att)
    out = {k: {a: round(float(b), 1) for a, b in v.items()} for k, v in out.items()}
    for k in ("qkv", "o", "gate_up", "down"):
        idx = [i for i, kk in enumerate(kinds) if kk == k and has[i].all()]
        if len(idx) < 2:
            continue
        run = np.stack([end[i] - staged[i] for i in idx])  # layers x blocks
        relr = run / run.mean(axis=1, keepdims=True)
        out[k]["run_cv_block"] = round(float(relr.mean(axis=0).std()), 4)
        out[k]["run_cv_noise"] = round(float(relr.std(axis=0).mean()), 4)
        late = np.stack([end[i] - end[i].mean() for i in idx])
        out[k]["end_sd_block"] = round(float(late.mean(axis=0).std()), 3)
        out[k]["end_sd_noise"] = round(float(late.std(axis=0).mean()), 3)
    first = start[0][has[0]].min()
    out["total"] = round(float(end[-1][has[-1]].max() - first), 1) if has[-1].any() else None
    return out


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
