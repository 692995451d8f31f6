"""Benchmarks and the device-API self-test of a kccl.Communicator, for bench/ and tests/.

Each function calls the benchmark extension of bench/native (built on first import:
bench/native/build.py), which links libkccl.so and works on the communicator (its
kccl.capi handle) through kccl.h only.  None of this is part of kccl.

The device-side ones take GPU arrays whatever the communicator: a host communicator
is refused by the library (KcclInvalidUsage)."""
import numbers
import os
import sys

import kccl
from kccl import capi
from kccl.errors import KcclInvalidArgument, error_for

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "native"))
import build as _native_build  # noqa: E402  (bench/native/build.py)

_native = _native_build.load()
_ffi, _lib = _native.ffi, _native.lib
sys.path.pop(0)

# Python's int for the names an argument may give an op (kccl.SUM, 0, "sum").
_OPS = {int(o): int(o) for o in kccl.Op}
_OPS.update({o.name.lower(): int(o) for o in kccl.Op})


def _check(rc):
    if rc:
        raise error_for(rc, _ffi.string(_lib.kb_last_error()).decode(errors="replace"))


def _as_int(value, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise KcclInvalidArgument(f"{what} must be an int, got {type(value).__name__}")
    return int(value)


def _op(op):
    code = _OPS.get(int(op) if isinstance(op, numbers.Integral) else op) if not isinstance(op, bool) else None
    if code is None:
        raise KcclInvalidArgument(f"unknown reduction op {op!r}; use kccl.SUM, PROD, MAX, MIN or AVG")
    return code


def _handle(comm):
    return _ffi.cast("void *", capi.handle(comm))


def _ptr(address):
    return _ffi.cast("void *", address)


def bench_all_reduce(comm, send, recv=None, op=kccl.SUM, iters=1000, *, dtype=None):
    """Mean microseconds of `iters` back-to-back all-reduces timed inside C."""
    handle, opc = _handle(comm), _op(op)
    iters = _as_int(iters, "iters")
    inplace = recv is None or recv is send
    sp, n, code, _ = capi.buffer(comm, send, dtype=dtype, writable=inplace, what="send (in place)" if inplace else "send")
    rp = sp
    if not inplace:
        rp, rn, rcode, _ = capi.buffer(comm, recv, dtype=dtype, writable=True, what="recv")
        if rn != n:
            raise KcclInvalidArgument(f"recv has {rn} elements, send has {n}")
        if rcode != code:
            raise KcclInvalidArgument(f"send is {capi.DTYPE_NAMES[code]} but recv is {capi.DTYPE_NAMES[rcode]}")
    out = _ffi.new("double *")
    _check(_lib.kb_bench_all_reduce(_ptr(sp), _ptr(rp), n, code, opc, handle, iters, out))
    return out[0]


def device_all_reduce_selftest(comm, inputs, outputs, op=kccl.SUM, iters=4, blocks=4, *, dtype=None, stream=None):
    """One persistent kernel of `blocks` blocks doing `iters` device-side all-reduces:
    row k of outputs (iters x inputs.size) gets the reduction of every rank's inputs + k.
    Blocks until done."""
    handle = _handle(comm)
    iters, blocks = _as_int(iters, "iters"), _as_int(blocks, "blocks")
    ip, n, code, library = capi.device_buffer(comm, inputs, dtype=dtype, what="inputs")
    op_, on, ocode, _ = capi.device_buffer(comm, outputs, dtype=dtype, writable=True, what="outputs")
    if ocode != code:
        raise KcclInvalidArgument(f"inputs is {capi.DTYPE_NAMES[code]} but outputs is {capi.DTYPE_NAMES[ocode]}")
    if on != n * iters:
        raise KcclInvalidArgument(f"outputs has {on} elements, needs iters*inputs = {n * iters}")
    st = capi.stream(comm, stream, library, device=True)
    _check(_lib.kb_dev_selftest(_ptr(ip), _ptr(op_), n, code, _op(op), iters, blocks, handle, _ptr(st)))
    return outputs


# kb_dev_group_selftest's out[] (kccl_bench.h's KB_GROUP_* order), the device-side claim left out.
_GROUP_FIELDS = ("wrong", "guard", "call_errors", "first_code", "bystander", "calls_ok", "bad_slot", "bad_call",
                 "bad_index", "bad_got", "bad_want")
_GROUP_CANCEL = {None: 0, "waiting": 1, "before": 2}


def device_all_reduce_group_selftest(comm, dtype="float32", op=kccl.SUM, count=512, calls=6, blocks=40, reducers=4,
                                     *, barrier=1, memory="shared", cancel=None, cancel_after_us=2000):
    """Collective: kcclDevAllReduceGroup as the monokernel calls it, checked on the device.

    One kernel of `blocks` blocks of 256 + 32 threads: in the grid's last `reducers`
    blocks (block blocks-1-s on slot s) the first 256 threads make `calls` group calls
    in a row at named barrier `barrier`, on `count` elements (every third call
    count//3 + 1) of small-integer inputs derived from (rank, slot, call, element), in
    the block's shared memory or in global memory (memory="global"); the 32-thread
    bystander warp never calls KCCL and keeps busy until its callers are done.  op:
    kccl.SUM, kccl.MAX, or None for sum and max in turn.

    cancel=None: returns a dict: wrong (elements not bitwise the exact result), guard
    (bytes past the data that a call changed), call_errors, first_code, bystander
    (bystander warps that waited in vain or left no mark), calls_ok (successful calls,
    all blocks), bad_slot/bad_call/bad_index/bad_got/bad_want (the first wrong element,
    -1 when none), ms (the kernel's time); a failed call or kernel raises.

    cancel="waiting" / "before": rank 1 never calls; every other rank's calls must end
    through the cancel word, stored by block 0's bystander cancel_after_us after it
    starts ("waiting") or before the launch ("before").  The communicator is broken
    afterwards; the dict then also has error: the KcclError the call reported, or
    None."""
    cancel_mode = _GROUP_CANCEL.get(cancel) if isinstance(cancel, (str, type(None))) else None
    if cancel_mode is None:
        raise KcclInvalidArgument(f"cancel={cancel!r}: None, 'waiting' or 'before'")
    if memory not in ("shared", "global"):
        raise KcclInvalidArgument(f"memory={memory!r}: 'shared' or 'global'")
    opc = -1 if op is None else _op(op)
    out, ms = _ffi.new("int[]", len(_GROUP_FIELDS) + 1), _ffi.new("double *")
    out[0] = -1  # stays so unless the kernel ran and its results came back
    rc = _lib.kb_dev_group_selftest(capi.dtype_code(dtype), opc, _as_int(count, "count"), _as_int(calls, "calls"),
                                    _as_int(blocks, "blocks"), _as_int(reducers, "reducers"),
                                    _as_int(barrier, "barrier"), int(memory == "global"), cancel_mode,
                                    _as_int(cancel_after_us, "cancel_after_us"), _handle(comm), out, ms)
    error = None
    try:
        _check(rc)
    except kccl.KcclError as e:
        if not cancel_mode or out[0] < 0:  # the error is the cancel case's outcome only once the kernel ran
            raise
        error = e
    res = dict(zip(_GROUP_FIELDS, out[0:len(_GROUP_FIELDS)]), ms=ms[0])
    if cancel_mode:
        res["error"] = error
    return res


def bench_device_all_reduce(comm, buf, iters=2000, blocks=1, *, dtype=None):
    """Microseconds per call of a dependent chain of device-side all-reduces (in-place
    average of buf) inside one persistent kernel."""
    handle = _handle(comm)
    p, n, code, _ = capi.device_buffer(comm, buf, dtype=dtype, writable=True, what="buf")
    out = _ffi.new("double *")
    _check(_lib.kb_bench_dev_all_reduce(_ptr(p), n, code, _as_int(iters, "iters"), _as_int(blocks, "blocks"),
                                        handle, out))
    return out[0]


def bench_device_all_reduce_phases(comm, buf, iters=2000, blocks=1, *, dtype=None):
    """The bench_device_all_reduce chain with block 0's time per call split into
    phases (kccl_device.cuh's traced copy, clock64 at the nominal SM clock): dict of
    us for 'pushed' (entry to pushes issued: epoch and input loads), 'received' (to
    every peer's line), 'end' (combine, store, barrier), and 'poll_rounds' per call."""
    handle = _handle(comm)
    p, n, code, _ = capi.device_buffer(comm, buf, dtype=dtype, writable=True, what="buf")
    out = _ffi.new("double[4]")
    _check(_lib.kb_bench_dev_all_reduce_phases(_ptr(p), n, code, _as_int(iters, "iters"), _as_int(blocks, "blocks"),
                                               handle, out))
    return {"pushed": out[0], "received": out[1], "end": out[2], "poll_rounds": out[3]}


def bench_residency(comm, blocks, timeout_ms=200, foreign=0, carveout=-1):
    """Collective: can every rank's `blocks` blocks (of a kernel with about the
    collective kernels' footprint) be resident at once?  foreign: a kernel this
    rank launches just before the probe (0 none, 1 without shared memory, 2 with
    40 KB of it).  carveout: the probe kernel's preferred shared-memory carveout in
    percent (-1: the driver's choice).  Returns a dict: seen (arrivals the
    best-placed block saw before its timeout), launched (blocks x ranks), regs (per
    thread), per_sm (blocks per SM by the occupancy calculator), sms (the SM of each
    of this rank's blocks)."""
    handle = _handle(comm)
    blocks = _as_int(blocks, "blocks")
    out = _ffi.new("int[4]")
    sms = _ffi.new("int[]", max(blocks, 1))
    _check(_lib.kb_bench_residency(handle, blocks, _as_int(timeout_ms, "timeout_ms"), _as_int(foreign, "foreign"),
                                   _as_int(carveout, "carveout"), out, sms))
    return {"seen": out[0], "launched": out[1], "regs": out[2], "per_sm": out[3], "sms": list(sms[0:blocks])}


def bench_flag_hop(comm, iters=10000, mode=0):
    """Collective (every rank calls it): microseconds for one flag hop between ranks 0
    and 1 through device memory (0.0 on other ranks, which only wait).  mode 0:
    release/acquire at system scope, pushed; 1: volatile, pushed; 2: relaxed at GPU
    scope, pushed; 3: volatile, pulled."""
    out = _ffi.new("double *")
    _check(_lib.kb_bench_flag_hop(_handle(comm), _as_int(iters, "iters"), _as_int(mode, "mode"), out))
    return out[0]
