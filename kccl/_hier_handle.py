"""The split-phase all-reduce of a communicator over several hosts (kccl.hierarchical).

Two KCCL split-phase all-reduces around the leaders' nonblocking MPI all-reduce: the
first (the host's sum) starts in all_reduce_start; once it has completed, the leader
posts the MPI all-reduce and polls it; then every rank of the host starts the second,
in which the leader contributes the result and the others the exact additive identity,
so that test() never blocks and every rank ends with the leader's bits."""
from mpi4py import MPI

from . import _hier_wire as wire
from .errors import KcclInvalidUsage


class HierAllReduceHandle:
    """A split-phase all-reduce across hosts: wait() blocks until the result is in recv and
    returns recv; test() never blocks and says whether it completed; done is test()."""

    def __init__(self, owner, first, r, recv, code, op):
        self._owner, self._first, self._r, self.recv = owner, first, r, recv
        self._code, self._op = code, op
        self._mpi = None   # the leader's (request, wire buffer)
        self._second = None
        self._finished = False

    def _live(self):
        o = self._owner
        o._live()
        if o._outstanding is not self:
            raise KcclInvalidUsage("the communicator of this all_reduce_start was closed")
        return o

    def _advance(self, block):
        """Moves the operation on as far as it can go without waiting (block=False) or to its
        end (block=True); returns whether it finished."""
        o = self._live()
        if self._second is None:
            if self._first is not None:
                if block:
                    o._call(self._first.wait)
                elif not o._call(self._first.test):
                    return False
                self._first = None
            if o._leaders is not None:
                if self._mpi is None:
                    try:
                        self._mpi = o._post_allreduce(o._leaders, self._r, self._code, self._op)
                        o._inflight = ([self._mpi[0]], (self._mpi, self._r))
                    except MPI.Exception as e:
                        o._explain_mpi_error("all_reduce_start", e)
                req, w = self._mpi
                if block:
                    o._wait([req], "all_reduce_start", w, self._r)
                else:
                    try:
                        if o._sig_req is not None and o._sig_req.Test():
                            o._sig_req = None
                            o._check_signatures()
                        if not (req.Test() and o._sig_req is None):
                            o._poll_notice()
                            return False
                        o._inflight = None
                    except MPI.Exception as e:
                        o._explain_mpi_error("all_reduce_start", e)
                wire.finish(self._r, w, self._code, self._op, o._size)
                contribution = self._r
            else:
                contribution = wire.identity_like(self._r, self._code)
            self._second = o._call(o._local.all_reduce_start, contribution, self._r, wire.SUM, dtype=self._code)
        if block:
            o._call(self._second.wait)
            done = True
        else:
            done = o._call(self._second.test)
        if done:
            self._finished = True
            o._outstanding = None
        return bool(done)

    def wait(self):
        if not self._finished:
            self._advance(True)
        return self.recv

    def test(self):
        return self._finished or self._advance(False)

    @property
    def done(self):
        return self.test()

    def __repr__(self):
        return f"<kccl.HierAllReduceHandle {'done' if self._finished else 'pending'}>"
