"""kccl.Communicator on CPU torch tensors: the remembered-pointer fast path of
all_reduce (right after the tensors change storage, size, dtype or layout), and
all_gather / reduce_scatter allocating a torch recv as they do a numpy one."""
import threading

import pytest

import kccl

torch = pytest.importorskip("torch")


def both(c0, c1, fn):
    """fn(comm, rank) on both ranks at once; returns [result0, result1]."""
    out = [None, None]

    def run0():
        out[0] = fn(c0, 0)

    t = threading.Thread(target=run0)
    t.start()
    out[1] = fn(c1, 1)
    t.join()
    return out


def test_all_reduce_of_torch_tensors_is_right_through_the_remembered_pointers(comm_pair):
    c0, c1 = comm_pair
    xs = [torch.full((1024,), float(r + 1)) for r in range(2)]
    for step in range(5):  # the same tensors every step: the cached pair
        for r in range(2):
            xs[r].fill_(float(r + 1 + step))
        both(c0, c1, lambda c, r: c.all_reduce(xs[r]))
        assert all(torch.equal(x, torch.full((1024,), float(3 + 2 * step))) for x in xs)
    for r in range(2):  # new storage and size behind the same objects
        xs[r].set_(torch.full((4096,), float(r + 1)))
    both(c0, c1, lambda c, r: c.all_reduce(xs[r]))
    assert all(torch.equal(x, torch.full((4096,), 3.0)) for x in xs)
    ys = [torch.full((8,), 2.0, dtype=torch.bfloat16) for _ in range(2)]
    outs = [torch.empty(8, dtype=torch.bfloat16) for _ in range(2)]
    both(c0, c1, lambda c, r: c.all_reduce(ys[r], outs[r], op=kccl.PROD))
    assert all(torch.equal(o, torch.full((8,), 4.0, dtype=torch.bfloat16)) for o in outs)


def test_all_reduce_refuses_a_tensor_it_cannot_take(comm1):
    x = torch.ones(4, 4)
    comm1.all_reduce(x)  # cached
    with pytest.raises(kccl.KcclInvalidArgument, match="contiguous"):
        comm1.all_reduce(x.t())
    with pytest.raises(kccl.KcclInvalidArgument):
        comm1.all_reduce(torch.ones(4, requires_grad=True))
    out = torch.empty(4, 4, dtype=torch.float64)
    with pytest.raises(kccl.KcclInvalidArgument):
        comm1.all_reduce(x, out)


def test_all_gather_and_reduce_scatter_allocate_torch_tensors(comm_pair):
    c0, c1 = comm_pair
    g = both(c0, c1, lambda c, r: c.all_gather(torch.full((3, 2), float(r), dtype=torch.float16)))
    for out in g:
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and out.shape == (2, 3, 2)
        assert torch.equal(out[0], torch.zeros(3, 2, dtype=torch.float16))
        assert torch.equal(out[1], torch.ones(3, 2, dtype=torch.float16))
    rs = both(c0, c1, lambda c, r: c.reduce_scatter(torch.arange(4, dtype=torch.int64) * (r + 1)))
    assert isinstance(rs[0], torch.Tensor)
    assert rs[0].tolist() == [0, 3] and rs[1].tolist() == [6, 9]
