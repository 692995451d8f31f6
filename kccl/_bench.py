"""Benchmarks and self-tests of a Communicator, for bench/ and tests/: each function
calls one of kccl.h's bench entry points (kcclBench*, kcclDevAllReduceSelfTest).
They are not part of the Communicator API.

The device-side ones take GPU arrays whatever the communicator: on a host
communicator the C library refuses them with KcclInvalidUsage."""
from ._buffers import check_same_dtype
from ._cuda_buffers import CudaBuffers
from ._native import ffi, lib
from .communicator import SUM, _as_int, _check, _resolve_op
from .errors import KcclInvalidArgument


def bench_all_reduce(comm, send, recv=None, op=SUM, iters=1000, *, dtype=None):
    """Mean microseconds of `iters` back-to-back all-reduces timed inside C."""
    handle = comm._handle()
    opc = _resolve_op(op)
    recv = send if recv is None else recv
    sp, rp, n, code, _ = comm._buffers.resolve_pair(send, recv, dtype)
    out = ffi.new("double *")
    _check(lib.kcclBenchAllReduce(sp, rp, n, code, opc, handle, _as_int(iters, "iters"), out))
    return out[0]


def device_all_reduce_selftest(comm, inputs, outputs, op=SUM, iters=4, blocks=4, *, dtype=None, stream=None):
    """One persistent kernel of `blocks` blocks doing `iters` device-side all-reduces:
    row k of outputs (iters x inputs.size) gets the reduction of every rank's inputs + k.
    Blocks until done."""
    handle, bufs = comm._handle(), CudaBuffers(comm._device)
    ip, n, code, library = bufs.resolve_buffer(inputs, dtype, False, "inputs")
    op_, on, ocode, _ = bufs.resolve_buffer(outputs, dtype, True, "outputs")
    check_same_dtype(code, ocode)
    if on != n * iters:
        raise KcclInvalidArgument(f"outputs has {on} elements, needs iters*inputs = {n * iters}")
    _check(lib.kcclDevAllReduceSelfTest(ip, op_, n, code, _resolve_op(op), _as_int(iters, "iters"),
                                        _as_int(blocks, "blocks"), handle, bufs.resolve_stream(stream, library)))
    return outputs


def bench_device_all_reduce(comm, buf, iters=2000, blocks=1, *, dtype=None):
    """Microseconds per call of a dependent chain of device-side all-reduces (in-place
    average of buf) inside one persistent kernel."""
    handle = comm._handle()
    p, n, code, _ = CudaBuffers(comm._device).resolve_buffer(buf, dtype, True, "buf")
    out = ffi.new("double *")
    _check(lib.kcclBenchDevAllReduce(p, n, code, _as_int(iters, "iters"), _as_int(blocks, "blocks"), handle, out))
    return out[0]


def bench_device_all_reduce_phases(comm, buf, iters=2000, blocks=1, *, dtype=None):
    """The bench_device_all_reduce chain with block 0's time per call split into
    phases: dict of us for 'pushed' (entry to pushes issued: epoch and input loads),
    'received' (to every peer's line), 'end' (combine, store, barrier), and
    'poll_rounds' per call."""
    handle = comm._handle()
    p, n, code, _ = CudaBuffers(comm._device).resolve_buffer(buf, dtype, True, "buf")
    out = ffi.new("double[4]")
    _check(lib.kcclBenchDevAllReducePhases(p, n, code, _as_int(iters, "iters"), _as_int(blocks, "blocks"), handle,
                                           out))
    return {"pushed": out[0], "received": out[1], "end": out[2], "poll_rounds": out[3]}


def bench_residency(comm, blocks, timeout_ms=200, foreign=0, carveout=-1):
    """Collective: can every rank's `blocks` blocks (of a kernel with about the
    collective kernels' footprint) be resident at once?  foreign: a kernel this
    rank launches just before the probe (0 none, 1 without shared memory, 2 with
    40 KB of it).  carveout: the probe kernel's preferred shared-memory carveout in
    percent (-1: the driver's choice).  Returns a dict: seen (arrivals the best-placed block saw before
    its timeout), launched (blocks x ranks), regs (per thread), per_sm (blocks per
    SM by the occupancy calculator), sms (the SM of each of this rank's blocks)."""
    handle = comm._handle()
    blocks = _as_int(blocks, "blocks")
    out = ffi.new("int[4]")
    sms = ffi.new("int[]", max(blocks, 1))
    _check(lib.kcclBenchResidency(handle, blocks, _as_int(timeout_ms, "timeout_ms"), _as_int(foreign, "foreign"),
                                  _as_int(carveout, "carveout"), out, sms))
    return {"seen": out[0], "launched": out[1], "regs": out[2], "per_sm": out[3], "sms": list(sms[0:blocks])}


def bench_flag_hop(comm, iters=10000, mode=0):
    """Microseconds for one flag hop between ranks 0 and 1 through device memory
    (0.0 on other ranks, which take no part).  mode 0: release/acquire at system scope,
    pushed; 1: volatile, pushed; 2: relaxed at GPU scope, pushed; 3: volatile, pulled."""
    out = ffi.new("double *")
    _check(lib.kcclBenchFlagHop(comm._handle(), _as_int(iters, "iters"), _as_int(mode, "mode"), out))
    return out[0]
