"""Every GPU branch of kccl.Communicator (and of bench/kccl_bench.py), run where there is no GPU.

A Communicator bound through _open to a NULL C handle on device 0 takes the CUDA buffer
adapter, as a GPU communicator does: each call checks its arguments, resolves fake GPU
arrays (__cuda_array_interface__ descriptions, never dereferenced) and its stream, and
reaches C, which refuses the NULL communicator with KcclInvalidArgument ("invalid
communicator").  A TypeError or AttributeError here is a wrong conversion on the GPU path."""
import os
import sys

import numpy as np
import pytest

import kccl
from kccl import _cuda_buffers
from kccl._native import ffi
from kccl.communicator import GpuAllReduceHandle
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import kccl_bench  # noqa: E402  (bench/kccl_bench.py)

REACHED_C = "invalid communicator"


class FakeCudaArray:
    """Only the description: nothing here is ever dereferenced."""

    def __init__(self, shape, typestr="<f4", readonly=False, ptr=0x7f0000001000):
        self.__cuda_array_interface__ = dict(shape=shape, typestr=typestr, strides=None, data=(ptr, readonly),
                                             version=3)


class FakeTorchStream:
    cuda_stream = 0x1234


@pytest.fixture
def gpu():
    c = kccl.Communicator.__new__(kccl.Communicator)
    c._open(ffi.NULL, 2, 0, 0, "no C communicator")
    yield c
    c.close()


def test_a_gpu_communicator_takes_the_cuda_adapter(gpu):
    assert gpu.device == 0 and isinstance(gpu._buffers, _cuda_buffers.CudaBuffers)
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as host:
        assert host.device is None and not isinstance(host._buffers, _cuda_buffers.CudaBuffers)


def test_every_collective_reaches_c(gpu):
    a, b = FakeCudaArray((4,)), FakeCudaArray((4,), ptr=0x7f0000002000)
    g = FakeCudaArray((8,), ptr=0x7f0000003000)
    calls = [lambda: gpu.all_reduce(a), lambda: gpu.all_reduce(a, b, op=kccl.MAX),
             lambda: gpu.all_reduce(a, dtype="float32"), lambda: gpu.all_reduce(a, stream=7),
             lambda: gpu.all_reduce(FakeCudaArray((4,), "<u2"), dtype="bfloat16", stream=FakeTorchStream()),
             lambda: gpu.all_reduce(np.ones(4, np.float32)),  # numpy takes the fast path; C refuses it
             lambda: gpu.all_reduce_start(a), lambda: gpu.all_reduce_start(a, b, "avg", stream=FakeTorchStream()),
             lambda: gpu.all_gather(a, g), lambda: gpu.all_gather(a, g, stream=7),
             lambda: gpu.reduce_scatter(g, a), lambda: gpu.reduce_scatter(g, a, op=kccl.MIN, stream=7),
             lambda: gpu.broadcast(a), lambda: gpu.broadcast(a, root=1, stream=7),
             lambda: gpu.barrier(), lambda: gpu.barrier(stream=FakeTorchStream())]
    for call in calls:
        with pytest.raises(kccl.KcclInvalidArgument, match=REACHED_C):
            call()


def test_gpu_argument_checks(gpu):
    a = FakeCudaArray((4,))
    cases = [
        (lambda: gpu.all_reduce(a, FakeCudaArray((8,))), "^recv has 8 elements, send 4"),
        (lambda: gpu.all_reduce(a, FakeCudaArray((4,), "<f8")), "^send is float32 but recv is float64"),
        (lambda: gpu.all_reduce(FakeCudaArray((4,), readonly=True)), "^send \\(in place\\) is read-only"),
        (lambda: gpu.all_reduce_start(a, FakeCudaArray((4,), readonly=True)), "^recv is read-only"),
        (lambda: gpu.all_reduce(np.ones(4, np.float32), dtype="float32"),
         "^send \\(in place\\) is ndarray in host memory: this communicator is on GPU 0"),
        (lambda: gpu.all_reduce(a, op="bogus"), "op"),
        (lambda: gpu.all_reduce(a, stream="s"), "stream must be"),
        (lambda: gpu.all_gather(a), "pass recv explicitly unless send is a torch tensor or CuPy array"),
        (lambda: gpu.all_gather(a, FakeCudaArray((4,))), "needs size\\*send = 8"),
        (lambda: gpu.all_gather(np.ones(4, np.float32), FakeCudaArray((8,))), "^send is ndarray in host memory"),
        (lambda: gpu.reduce_scatter(FakeCudaArray((5,))), "not a multiple of size=2"),
        (lambda: gpu.reduce_scatter(FakeCudaArray((8,))), "pass recv explicitly"),
        (lambda: gpu.reduce_scatter(FakeCudaArray((8,)), FakeCudaArray((3,))), "needs send/size = 4"),
        (lambda: gpu.broadcast(a, root=2), "root 2 out of range"),
        (lambda: gpu.broadcast(FakeCudaArray((4,), readonly=True)), "^buf is read-only"),
        (lambda: gpu.barrier(stream=1.5), "stream must be"),
    ]
    for call, message in cases:
        with pytest.raises(kccl.KcclInvalidArgument, match=message):
            call()


def test_gpu_arrays_on_another_device_are_refused(gpu, monkeypatch):
    def on_gpu_1(obj, dtype, writable, what):
        return 0x7f0000001000, 4, kccl._buffers.FLOAT32, 1, "cai"

    monkeypatch.setattr(_cuda_buffers, "resolve_cuda_buffer", on_gpu_1)
    with pytest.raises(kccl.KcclInvalidArgument, match="send \\(in place\\) is on GPU 1, this communicator on GPU 0"):
        gpu.all_reduce(FakeCudaArray((4,)))


def test_torch_recv_is_allocated_like_send(gpu):
    """recv=None allocates with send.new_empty; a CPU tensor is then refused as host memory."""
    torch = pytest.importorskip("torch")
    with pytest.raises(kccl.KcclInvalidArgument, match="^send is Tensor in host memory"):
        gpu.all_gather(torch.ones(3))
    with pytest.raises(kccl.KcclInvalidArgument, match="^send is Tensor in host memory"):
        gpu.reduce_scatter(torch.ones(4))


def test_gpu_handle_waits_through_c_and_refuses_a_closed_communicator(gpu):
    a = FakeCudaArray((4,))
    h = GpuAllReduceHandle(gpu, gpu._comm, 1, a)
    assert "pending" in repr(h)
    for call in (lambda: h.wait(), lambda: h.wait(stream=7), lambda: h.wait(stream=FakeTorchStream())):
        with pytest.raises(kccl.KcclInvalidArgument, match=REACHED_C):
            call()
    with pytest.raises(kccl.KcclInvalidArgument, match="stream must be"):
        h.wait(stream="s")
    gpu.close()
    with pytest.raises(kccl.KcclInvalidUsage, match="closed"):
        h.wait()


def test_bench_functions_reach_c(gpu):
    a, b = FakeCudaArray((4,)), FakeCudaArray((4,), ptr=0x7f0000002000)
    calls = [lambda: kccl_bench.bench_all_reduce(gpu, a, iters=2), lambda: kccl_bench.bench_all_reduce(gpu, a, b, "max"),
             lambda: kccl_bench.device_all_reduce_selftest(gpu, a, FakeCudaArray((16,)), iters=4, stream=7),
             lambda: kccl_bench.device_all_reduce_selftest(gpu, a, FakeCudaArray((8,)), iters=2, blocks=1),
             lambda: kccl_bench.bench_device_all_reduce(gpu, a, iters=10),
             lambda: kccl_bench.bench_device_all_reduce_phases(gpu, a),
             lambda: kccl_bench.bench_residency(gpu, 8), lambda: kccl_bench.bench_flag_hop(gpu, 10, 1),
             lambda: kccl_bench.device_all_reduce_group_selftest(gpu),
             lambda: kccl_bench.device_all_reduce_group_selftest(gpu, "bfloat16", None, 4096, memory="global"),
             lambda: kccl_bench.device_all_reduce_group_selftest(gpu, cancel="waiting")]
    for call in calls:
        with pytest.raises(kccl.KcclInvalidArgument, match=REACHED_C):
            call()


def test_bench_argument_checks(gpu):
    a = FakeCudaArray((4,))
    cases = [(lambda: kccl_bench.bench_all_reduce(gpu, a, FakeCudaArray((5,))), "elements"),
             (lambda: kccl_bench.bench_all_reduce(gpu, a, iters=1.5), "iters must be an int"),
             (lambda: kccl_bench.device_all_reduce_selftest(gpu, a, FakeCudaArray((8,)), iters=4),
              "needs iters\\*inputs = 16"),
             (lambda: kccl_bench.device_all_reduce_selftest(gpu, a, FakeCudaArray((16,), "<f8")),
              "float32 but outputs is float64"),
             (lambda: kccl_bench.device_all_reduce_selftest(gpu, a, FakeCudaArray((16,)), blocks="4"), "blocks must be"),
             (lambda: kccl_bench.bench_device_all_reduce(gpu, np.ones(4, np.float32)), "in host memory"),
             (lambda: kccl_bench.bench_residency(gpu, None), "blocks must be"),
             (lambda: kccl_bench.bench_flag_hop(gpu, mode=True), "mode must be")]
    for call, message in cases:
        with pytest.raises(kccl.KcclInvalidArgument, match=message):
            call()


def test_group_selftest_argument_checks(gpu):
    """Checked before the communicator: the range of every argument of the group self-test."""
    g = kccl_bench.device_all_reduce_group_selftest
    cases = [(lambda: g(gpu, "float64"), "dtype"), (lambda: g(gpu, "int32"), "dtype"),
             (lambda: g(gpu, op=kccl.MIN), "op 3: sum, max"), (lambda: g(gpu, op="bogus"), "unknown reduction op"),
             (lambda: g(gpu, count=0), "count=0: 1..2048"), (lambda: g(gpu, count=2049), "count=2049: 1..2048"),
             (lambda: g(gpu, "bfloat16", count=4097), "count=4097: 1..4096"),
             (lambda: g(gpu, calls=0), "calls=0"), (lambda: g(gpu, calls=1.0), "calls must be an int"),
             (lambda: g(gpu, blocks=0), "blocks=0"), (lambda: g(gpu, blocks=257), "blocks=257"),
             (lambda: g(gpu, blocks=4, reducers=5), "reducers=5"), (lambda: g(gpu, blocks=40, reducers=33),
                                                                    "reducers=33"),
             (lambda: g(gpu, reducers=0), "reducers=0"), (lambda: g(gpu, barrier=0), "barrier=0"),
             (lambda: g(gpu, barrier=16), "barrier=16"), (lambda: g(gpu, memory="host"), "memory="),
             (lambda: g(gpu, cancel="yes"), "cancel="), (lambda: g(gpu, cancel=1), "cancel="),
             (lambda: g(gpu, cancel="waiting", cancel_after_us=-1), "cancelAfterUs=-1")]
    for call, message in cases:
        with pytest.raises(kccl.KcclInvalidArgument, match=message):
            call()


def test_closed_gpu_communicator_refuses_every_call(gpu):
    a = FakeCudaArray((4,))
    gpu.close()
    assert gpu.closed and "closed" in repr(gpu)
    calls = [lambda: gpu.all_reduce(a), lambda: gpu.all_reduce_start(a), lambda: gpu.all_gather(a, a),
             lambda: gpu.reduce_scatter(a, a), lambda: gpu.broadcast(a), lambda: gpu.barrier(),
             lambda: gpu.dev_comm(), lambda: gpu.gpu_flag_replicas(), lambda: kccl_bench.bench_all_reduce(gpu, a),
             lambda: kccl_bench.bench_device_all_reduce(gpu, a), lambda: kccl_bench.bench_flag_hop(gpu)]
    for call in calls:
        with pytest.raises(kccl.KcclInvalidUsage, match="closed"):
            call()


# -- the torch fast path of all_reduce (decode's eager calls) -----------------------------------

class FakeTorchTensor:
    """What the fast path reads of a torch tensor; the full resolve is stubbed (no GPU here)."""

    def __init__(self, ptr=0x7f0000010000, n=4096, dtype="bf16", contiguous=True):
        self.ptr, self.n, self.dtype, self.contiguous = ptr, n, dtype, contiguous

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.n

    def is_contiguous(self):
        return self.contiguous


@pytest.fixture
def resolves(monkeypatch):
    """Counts the full resolves CudaBuffers.torch_pair falls back to."""
    seen = []

    def resolve_pair(self, send, recv, dtype):
        seen.append(1)
        if not send.contiguous:
            raise kccl.KcclInvalidArgument("send is not contiguous")
        sp = ffi.cast("void *", send.ptr)
        return sp, sp if recv is send else ffi.cast("void *", recv.ptr), send.n, 9, "torch"
    monkeypatch.setattr(_cuda_buffers.CudaBuffers, "resolve_pair", resolve_pair)
    return seen


def test_the_torch_pair_is_remembered_until_anything_about_it_changes(resolves):
    bufs = _cuda_buffers.CudaBuffers(0)
    x, y = FakeTorchTensor(), FakeTorchTensor(ptr=0x7f0000020000)
    first = bufs.torch_pair(x, x)
    assert bufs.torch_pair(x, x) == first and len(resolves) == 1       # same tensor: no resolve
    x.n = 2048                                                         # resized in place
    assert bufs.torch_pair(x, x)[2] == 2048 and len(resolves) == 2
    x.dtype = "f16"                                                    # .data swapped for another view
    bufs.torch_pair(x, x)
    x.ptr += 64                                                        # another storage
    bufs.torch_pair(x, x)
    x.contiguous = False                                               # strided in place: checked in full
    with pytest.raises(kccl.KcclInvalidArgument, match="contiguous"):
        bufs.torch_pair(x, x)
    x.contiguous = True
    bufs.torch_pair(x, x)
    assert len(resolves) == 5
    y.dtype, y.n = x.dtype, x.n
    bufs.torch_pair(x, y)                                              # out of place: recv matters too
    bufs.torch_pair(x, y)
    y.ptr += 64
    bufs.torch_pair(x, y)
    assert len(resolves) == 7
    bufs.torch_pair(FakeTorchTensor(ptr=x.ptr, n=x.n, dtype=x.dtype), y)  # an equal but other tensor
    assert len(resolves) == 8
    bufs.forget()
    bufs.torch_pair(x, y)
    assert len(resolves) == 9


def test_the_torch_pair_does_not_keep_tensors_alive(resolves):
    import gc
    import weakref
    bufs = _cuda_buffers.CudaBuffers(0)
    x = FakeTorchTensor()
    bufs.torch_pair(x, x)
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None


def test_the_torch_stream_pointer_follows_the_current_stream(monkeypatch):
    current = [0x1234]
    monkeypatch.setattr(_cuda_buffers, "_raw_stream", lambda dev: current[0])
    bufs = _cuda_buffers.CudaBuffers(0)
    s = bufs.torch_stream()
    assert int(ffi.cast("uintptr_t", s)) == 0x1234 and bufs.torch_stream() is s
    current[0] = 0
    assert int(ffi.cast("uintptr_t", bufs.torch_stream())) == 0


def test_a_torch_all_reduce_reaches_c_through_the_fast_path(gpu, resolves, monkeypatch):
    monkeypatch.setattr(_cuda_buffers, "TORCH_TENSOR", FakeTorchTensor)
    monkeypatch.setattr(_cuda_buffers, "_raw_stream", lambda dev: 0x1234)
    x = FakeTorchTensor()
    for op in (kccl.SUM, "max", 4):
        with pytest.raises(kccl.KcclInvalidArgument, match=REACHED_C):
            gpu.all_reduce(x, op=op)
    assert len(resolves) == 1                                          # resolved once, then remembered
    with pytest.raises(kccl.KcclInvalidArgument, match="op"):
        gpu.all_reduce(x, op=99)
    gpu.close()
    with pytest.raises(kccl.KcclInvalidUsage, match="closed"):
        gpu.all_reduce(x)
