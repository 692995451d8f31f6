"""A communicator over several hosts: KCCL inside each host, MPI between hosts.

Communicator.from_mpi builds one when its MPI world spans more than one host key
(kccl.hosts).  Each host's ranks form an ordinary KCCL communicator (`local`);
between hosts it uses communicators split from a private duplicate of the MPI world:

- `leaders`: the lowest rank of each host, in host order (small messages,
  broadcast, all-gather, barrier, the cross-host signature check);
- one `shard` communicator per shard of the large all-reduce (below);
- `ctrl`: failure notices, so that a failure seen on one host raises on all.

All-reduce by size (KCCL_HIER_LARGE_BYTES):

- small: all-reduce inside the host (KCCL has no reduce; its one-shot all-reduce
  costs one cache-line hop per peer like a reduce would, and leaves the host's sum
  on the leader), among the leaders one MPI all-gather of (signature, host sum) that
  each leader combines in host order (an MPI all-reduce once the hosts' sums together
  pass _GATHER_MAX_BYTES), broadcast inside the host, which non-leaders enter asleep
  (expect_long_wait: their leader is on the network meanwhile).  A repeated call with the
  same numpy pair takes _small_hot (kccl/_hier_small.py: everything resolved once).
- large: the vector is cut into M shards, M the largest host's rank count.  A host
  of L ranks gives each local rank c = ceil(M / L) consecutive shards: a reduce-scatter
  inside the host over L blocks of c shards (the vector padded to L*c shards when that
  is longer), then every rank all-reduces each of its shards with the ranks holding
  the same shard on the other hosts (one MPI communicator per shard, all in flight at
  once), then an all-gather inside the host.  With equal hosts c = 1 and shard
  communicator j is "local rank j of every host"; with 2 + 1 ranks the lone rank
  holds both shards and takes part in both shard communicators.

The split-phase all-reduce is the small path in two KCCL split-phase operations:
all_reduce_start starts the host's all-reduce at once; test()/wait() then, on the
leader, post the MPI all-reduce once the host's sum is there and poll it, and every
rank finally starts a second KCCL all-reduce in which the leader contributes the
result and the others the additive identity (-0.0 / 0), so that no test() blocks.

Failures: KCCL's own waits see a local peer die within about 1 ms; the rank that
sees it sends a notice to every rank over `ctrl` and aborts its host's KCCL
communicator, so its host's ranks raise at once and the other hosts' ranks raise
as soon as they poll (every MPI wait here polls `ctrl`, and a rank whose local
communicator was aborted by its leader looks for the notice before raising).  MPI
itself does not report a dead peer (MPICH's Test keeps returning false), so a
death no rank of its host survives to see (a host of one rank) ends in KcclTimeout
after KCCL_TIMEOUT_MS, naming the collective that did not finish.  Under mpiexec's
default (auto-cleanup) the launcher kills every rank when one dies."""
import os
import pickle
import re
import time

import numpy as np
from mpi4py import MPI

from . import _hier_wire as wire
from ._hier_small import SmallAllReduce
from ._native import ffi, lib
from .errors import check as _check_rc
from ._hier_handle import HierAllReduceHandle
from .hosts import machine_key
from .errors import KcclError, KcclInvalidArgument, KcclInvalidUsage, KcclRemoteError, KcclTimeout, error_for

_NOTICE_TAG = 0x4B43  # "KC": the only tag used on the private ctrl communicator
_GRACE_S = 1.0  # how long a rank aborted by its own leader looks for the cause's notice
_KINDS = {1: "all_reduce", 2: "all_gather", 3: "reduce_scatter", 4: "broadcast", 5: "barrier",
          6: "all_reduce_start"}
_RANK_WORD = re.compile(r"\brank (\d+)\b")
_DIED = re.compile(r"\brank (\d+) \(pid \d+\) died")
# MPI requests a failure left in flight, with their buffers: MPI may still write into
# those buffers later (a collective request cannot be cancelled), so they live as long
# as the process does.  Only failures add to it.
_ABANDONED = []
_SIG_BYTES = 48  # a collective's signature: six int64 (kind, op, type, count, root, sequence)
# Small all-reduces whose host sums, all hosts' together, stay within this many bytes send
# them to every leader (one all-gather, signature included) instead of all-reducing them
# beside a separate signature exchange: latency-bound sizes, where one exchange beats two.
_GATHER_MAX_BYTES = 64 * 1024
_c_allreduce, _c_broadcast, _c_expect_long_wait = lib.kcclAllReduce, lib.kcclBroadcast, lib.kcclCommExpectLongWait
_NULL = ffi.NULL


class _NoHot:  # matches no buffer: all_reduce's remembered pair before the first small call
    send = recv = op = dtype = object()


_NO_HOT = _NoHot()
_COMBINE = {wire.SUM: np.add, wire.AVG: np.add, wire.PROD: np.multiply, wire.MAX: np.maximum,
            wire.MIN: np.minimum}


def _resolve_op(op):
    names = {n: c for c, n in wire.OP_NAMES.items()}
    if isinstance(op, str) and op.lower() in names:
        return names[op.lower()]
    if isinstance(op, (int, np.integer)) and not isinstance(op, bool) and int(op) in wire.OP_NAMES:
        return int(op)
    raise KcclInvalidArgument(f"unknown reduction op {op!r}; use kccl.SUM, PROD, MAX, MIN or AVG")


def _shared_cores_config(machine_ranks, host_ranks, settings):
    """Settings for the host's KCCL communicator when ranks of several hosts share this
    machine's cores (hosts simulated with KCCL_HOST_ID) and outnumber them.

    KCCL's automatic waits spin only when its own ranks have a core each; here a host's
    ranks may fit the cores while the machine's do not, and a rank spinning in a KCCL wait
    holds the core a leader needs for the MPI leg (measured, 2 x 2 ranks on 2 cores: a
    4-byte all-reduce inside the host 25 us spinning, 5 us yielding).  So the host
    communicator is told what KCCL's own rule says for ranks that outnumber the cores:
    no spin, sched_yield, then sleep.  An explicit KCCL_SPIN_US / KCCL_YIELD_US wins; on
    a real cluster (one host per machine) nothing changes."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if machine_ranks <= max(cores, host_ranks):
        return {}
    if any(settings[k][1] != "default" for k in ("KCCL_SPIN_US", "KCCL_YIELD_US")):
        return {}
    return {"spin_us": 0}


def _no_stream(stream):
    if stream is not None:
        raise KcclInvalidArgument("stream= is for GPU communicators; a communicator over several hosts is a "
                                  "host one")


class HierarchicalCommunicator:
    """KCCL inside each host, MPI between hosts: the same collectives as kccl.Communicator
    (host buffers only).  Built by Communicator.from_mpi; see the module's text."""

    def __init__(self, mpi_comm, layout, make_local, settings):
        self._closed_why = None
        self._local = None
        self._comms = []
        world = mpi_comm.Dup()  # private: none of our messages can match the caller's
        world.Set_errhandler(MPI.ERRORS_RETURN)
        self._comms.append(world)
        self._world, self._layout = world, layout
        self._rank, self._size = world.Get_rank(), world.Get_size()
        self._host = layout.host_of[self._rank]
        self._lrank, self._lsize = layout.local_rank[self._rank], layout.sizes[self._host]
        self._members = layout.members[self._host]
        timeout_ms = settings["KCCL_TIMEOUT_MS"][0]
        self._timeout_s = timeout_ms / 1000.0 if timeout_ms else None
        self._large = settings["KCCL_HIER_LARGE_BYTES"][0]
        self._check = settings["KCCL_HIER_CHECK"][0] == "on"
        mine = (self._large, int(self._check))
        every = world.allgather((mine, machine_key()))
        if any(v != mine for v, _m in every):
            bad = next(r for r, (v, _m) in enumerate(every) if v != mine)
            world.Free()
            raise KcclInvalidArgument(f"KCCL_HIER_LARGE_BYTES / KCCL_HIER_CHECK must be equal on all ranks: rank "
                                      f"{self._rank} has {mine}, rank {bad} has {every[bad][0]}")
        machines = [m for _v, m in every]
        local_config = _shared_cores_config(machines.count(machines[self._rank]), self._lsize, settings)
        self.local_config = local_config  # what the host communicator was given (bench/hier_allreduce.py reuses it)
        self._ctrl = self._split(0)
        self._leaders = self._split(0 if self._lrank == 0 else MPI.UNDEFINED, key=self._host)
        # shards of the large all-reduce: M of them, host h's local rank j holds [j*c_h, (j+1)*c_h)
        self._nshards = max(layout.sizes)
        self._per_rank = -(-self._nshards // self._lsize)
        first = self._lrank * self._per_rank
        self._my_shards = [s for s in range(first, first + self._per_rank) if s < self._nshards]
        self._shard_comms = {}
        for s in range(self._nshards):
            c = self._split(0 if s in self._my_shards else MPI.UNDEFINED, key=self._host)
            if c is not None:
                self._shard_comms[s] = c
        intra = world.Split(self._host, self._rank)
        intra.alltoall([None] * intra.Get_size())  # connects every pair of the host for failure notices
        err = None
        try:
            self._local = make_local(intra, local_config)
        except KcclError as e:
            err = e
        finally:
            intra.Free()
        failed = world.allgather(None if err is None else f"{type(err).__name__}: {err}")
        if any(failed):
            bad = [f"rank {r}: {t}" for r, t in enumerate(failed) if t]
            self._release(abort=True)
            if err is not None:
                raise err
            raise KcclRemoteError("KCCL init failed on another host: " + "; ".join(bad))
        self._seq = 0
        self._sigs = np.zeros((layout.nhosts, 6), np.int64) if self._leaders is not None else None
        self._sig_req = None
        self._gather_bufs = None
        self._outstanding = None
        self._notices = []
        self._inflight = None
        self._hot = _NO_HOT
        self._pid = os.getpid()

    def _split(self, color, key=0):
        c = self._world.Split(color, key)
        if c == MPI.COMM_NULL:
            return None
        c.Set_errhandler(MPI.ERRORS_RETURN)
        self._comms.append(c)
        return c

    # -- properties -----------------------------------------------------------------
    @property
    def rank(self):
        return self._rank

    @property
    def size(self):
        return self._size

    @property
    def device(self):
        return None

    @property
    def closed(self):
        return self._local is None

    @property
    def hosts(self):
        return self._layout.nhosts

    @property
    def host(self):
        return self._host

    def __repr__(self):
        state = "closed" if self._local is None else "open"
        return (f"<kccl.HierarchicalCommunicator rank {self._rank}/{self._size} host {self._host}/"
                f"{self._layout.nhosts} {state}>")

    def topo_info(self):
        """The host communicator's topo_info, plus "hosts" (how many), "host" (this rank's
        index), "local_rank" and "local_size" (its place among its host's ranks) and
        "large_bytes" (KCCL_HIER_LARGE_BYTES: where all-reduce takes the large path) and
        "gather_max_bytes" (the most a small all-reduce's leaders gather from the other hosts
        in one exchange; beyond it they all-reduce instead)."""
        info = self._call(self._live().topo_info)
        info.update(hosts=self._layout.nhosts, host=self._host, local_rank=self._lrank, local_size=self._lsize,
                    large_bytes=self._large, gather_max_bytes=_GATHER_MAX_BYTES)
        return info

    # -- failures -------------------------------------------------------------------
    def _live(self):
        if self._local is None:
            raise KcclInvalidUsage(f"communicator is closed ({self._closed_why or 'never initialised'})")
        if self._closed_why is not None:
            raise KcclInvalidUsage(f"communicator is broken: {self._closed_why}")
        return self._local

    def _world_text(self, text):
        """KCCL's local text with its local rank numbers replaced by world ranks."""
        def sub(m):
            i = int(m.group(1))
            return f"rank {self._members[i]}" if i < len(self._members) else m.group(0)
        return _RANK_WORD.sub(sub, text)

    def _fail(self, cls, text, notify=True, skip=()):
        """This rank saw the failure first: tell every rank (but `skip`), abort the host's
        KCCL communicator (its blocked ranks raise at once), raise.

        A message to a dead rank can crash this process inside MPI (MPICH over UCX has no
        peer-failure handling unless built for it; so can any MPI progress while requests
        towards a dead rank are in flight), so known dead ranks are skipped, and a timeout,
        whose cause may be any rank, is neither told nor forwarded by an abort: every rank's
        wait, KCCL's and MPI's alike, ends under the same KCCL_TIMEOUT_MS by itself."""
        if self._closed_why is None:
            self._closed_why = text
            _ABANDONED.append((self._inflight, self._sig_req, self._sigs, getattr(self, "_mysig", None)))
            self._inflight = self._sig_req = None
            if cls is KcclTimeout:
                raise cls(text)
            if notify:
                data = pickle.dumps((cls.code, text))
                for r in range(self._size):
                    if r != self._rank and r not in skip:
                        try:
                            self._notices.append(self._ctrl.Isend([data, MPI.BYTE], dest=r, tag=_NOTICE_TAG))
                        except MPI.Exception:
                            pass  # that rank's link failed too; it learns another way or times out
            if self._local is not None:
                self._local.abort()
            if notify:
                # MPI moves a message only inside MPI calls: push the notices out, for a bounded
                # time, before this rank returns (and perhaps exits).  After the abort, so that
                # this host's ranks, woken by it, take part (a first message between two ranks
                # may need both to make progress) while they look for the notice.
                end = time.monotonic() + _GRACE_S
                try:
                    while not MPI.Request.Testall(self._notices) and time.monotonic() < end:
                        time.sleep(0.0005)
                except MPI.Exception:
                    pass
        raise cls(text)

    def _poll_notice(self):
        """A failure notice from another rank, raised, if one has arrived."""
        status = MPI.Status()
        if self._ctrl.Iprobe(MPI.ANY_SOURCE, _NOTICE_TAG, status):
            data = bytearray(status.Get_count(MPI.BYTE))
            self._ctrl.Recv([data, MPI.BYTE], status.Get_source(), _NOTICE_TAG)
            code, text = pickle.loads(bytes(data))
            self._fail(type(error_for(code, text)), text, notify=False)

    def _call(self, fn, *args, **kw):
        """A call on the host's KCCL communicator; its failure becomes every rank's."""
        try:
            return fn(*args, **kw)
        except KcclError as e:
            if self._closed_why is not None:
                raise KcclRemoteError(self._closed_why) from None
            text = self._world_text(str(e))
            if isinstance(e, KcclRemoteError) and " aborted " in text:
                # A peer here aborted: on a failure it announced itself (look for that notice,
                # which names the cause), or on a timeout or at close, which are not announced
                # (see _fail): either way nothing more to tell.
                end = time.monotonic() + _GRACE_S
                while time.monotonic() < end:
                    self._poll_notice()
                    time.sleep(0.001)
                self._fail(type(e), f"host {self._host}: {text}", notify=False)
            dead = {int(r) for r in _DIED.findall(text)}
            self._fail(type(e), f"host {self._host}: {text}", skip=dead)

    def _wait(self, reqs, what, *keep):
        """Completes MPI requests, checking the signature exchange and the failure notices
        while waiting, within KCCL_TIMEOUT_MS.  keep: the requests' buffers, kept alive if
        a failure leaves the requests in flight."""
        self._inflight = (reqs, keep)
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        spins = 0
        try:
            while True:
                if self._sig_req is not None and self._sig_req.Test():
                    self._sig_req = None
                    self._check_signatures()
                if MPI.Request.Testall(reqs) and self._sig_req is None:
                    self._inflight = None
                    return
                spins += 1
                if spins & 15 == 0:
                    self._poll_notice()
                    if deadline is not None and time.monotonic() > deadline:
                        self._fail(KcclTimeout, f"{what}: the inter-host part did not finish within "
                                                f"{self._timeout_s * 1000:.0f} ms (KCCL_TIMEOUT_MS); a rank on another "
                                                "host may have died (MPI does not report it) or stopped calling")
                if spins > 64:  # ranks may outnumber cores: let the others run, then sleep
                    if spins < 2048:
                        os.sched_yield()
                    else:
                        time.sleep(50e-6)
        except MPI.Exception as e:
            self._explain_mpi_error(what, e)

    def _explain_mpi_error(self, what, e):
        """An MPI error: a mismatch across hosts makes MPI fail (truncation) or not, so the
        signature exchange, when one is in flight, names the cause first.  A truncated
        signature-and-data block (_gathered_allreduce) means another leader received this
        one's longer block, read the signature in front and is announcing the mismatch:
        that notice is waited for."""
        end = time.monotonic() + _GRACE_S
        truncated = e.Get_error_class() == MPI.ERR_TRUNCATE
        try:
            while (self._sig_req is not None or truncated) and time.monotonic() < end:
                if self._sig_req is not None and self._sig_req.Test():
                    self._sig_req = None
                    self._check_signatures()
                if truncated:
                    self._poll_notice()
                    time.sleep(0.0005)
        except MPI.Exception:
            pass
        self._fail(KcclRemoteError, f"{what}: MPI error between hosts: {e.Get_error_string()}")

    # -- cross-host signature ----------------------------------------------------------
    def _begin(self, kind, op=0, code=0, count=0, root=-1, post=True):
        """Every collective's first step: refuse while a split-phase one is outstanding, and
        on leaders post the signature exchange (completed by the next _wait), unless the
        caller sends the signature with its data (post=False)."""
        local = self._live()
        if self._outstanding is not None and kind != 6:
            raise KcclInvalidUsage("a blocking collective while an all_reduce_start is outstanding: wait for it "
                                   "first")
        self._seq += 1
        if self._check and self._leaders is not None:
            self._mysig = np.array([kind, op, code, count, root, self._seq], np.int64)
            if not post:
                return local
            try:
                self._sig_req = self._leaders.Iallgather([self._mysig, MPI.INT64_T], [self._sigs, MPI.INT64_T])
            except MPI.Exception as e:
                self._explain_mpi_error(_KINDS[kind], e)
        return local

    @staticmethod
    def _describe(sig):
        kind, op, code, count, root, seq = (int(v) for v in sig)
        name = _KINDS.get(kind, f"collective {kind}")
        if kind in (1, 3, 6):
            return f"{name}(count={count}, {wire.type_name(code)}, op={wire.OP_NAMES.get(op, op)}) #{seq}"
        if kind == 4:
            return f"{name}(count={count}, {wire.type_name(code)}, root={root}) #{seq}"
        if kind == 2:
            return f"{name}(count={count}, {wire.type_name(code)}) #{seq}"
        return f"{name}() #{seq}"

    def _check_signatures(self):
        mine = self._mysig
        for h, sig in enumerate(self._sigs):
            if not np.array_equal(sig, mine):
                leader = self._layout.members[h][0]
                self._fail(KcclRemoteError, f"collective mismatch across hosts: rank {leader} (host {h}) called "
                                            f"{self._describe(sig)} but rank {self._rank} (host {self._host}) "
                                            f"called {self._describe(mine)}")

    def _settle_signature(self, what):
        if self._sig_req is not None:
            self._wait([], what)

    # -- the inter-host all-reduce of one block -------------------------------------------
    def _post_allreduce(self, comm, block, code, op):
        wire_buf = wire.to_wire(block, code)
        req = comm.Iallreduce(MPI.IN_PLACE, [wire_buf, wire.MPI_TYPE[code]], op=wire.MPI_OP[op])
        return req, wire_buf

    # -- collectives ----------------------------------------------------------------
    def all_reduce(self, send, recv=None, op=wire.SUM, *, dtype=None, stream=None):
        """recv = the reduction over every rank of every host; in place when recv is omitted.

        The last small numpy pair is remembered (_hier_small): a call with the same arrays,
        op object and no dtype=/stream= goes through _small_hot without resolving anything
        again (writability is still checked every call)."""
        if recv is None:
            recv = send
        h = self._hot
        if (send is h.send and recv is h.recv and op is h.op and dtype is None and stream is None
                and send.dtype is h.dtype and recv.flags.writeable):
            return self._small_hot(h)
        _no_stream(stream)
        opc = _resolve_op(op)
        s, code = wire.plain_view(send, dtype, recv is send)
        r, rcode = (s, code) if recv is send else wire.plain_view(recv, dtype, True)
        plain = code is not None and rcode == code and r.size == s.size
        if not plain:
            s, code, _ks = wire.view(send, dtype, recv is send, "send (in place)" if recv is send else "send")
            if recv is send:
                r = s
            else:
                r, rcode, _kr = wire.view(recv, dtype, True, "recv")
                if rcode != code:
                    raise KcclInvalidArgument(f"send is {wire.type_name(code)} but recv is {wire.type_name(rcode)}")
                if r.size != s.size:
                    raise KcclInvalidArgument(f"recv has {r.size} elements, send {s.size}: all_reduce needs equal "
                                              "sizes")
        large = s.nbytes >= self._large and s.size >= self._nshards
        gathered = not large and s.nbytes * (self._layout.nhosts - 1) <= _GATHER_MAX_BYTES
        local = self._begin(1, opc, code, s.size, post=not gathered)
        local_op = wire.SUM if opc == wire.AVG else opc
        if large:
            self._large_allreduce(local, s, r, code, opc, local_op)
            return recv
        if plain and gathered and code not in wire.HALF and type(send) is np.ndarray and type(recv) is np.ndarray:
            self._seq -= 1  # _small_hot counts this call itself
            self._hot = SmallAllReduce(send, recv, op, opc, code, r, self._layout.nhosts, self._leaders is not None)
            return self._small_hot(self._hot)
        if plain:  # the originals: the host communicator's remembered-pair fast path takes them
            self._call(local.all_reduce, send, recv, local_op)
        else:
            self._call(local.all_reduce, s, r, local_op, dtype=code)
        if self._leaders is None:
            local.expect_long_wait()  # the leader is in the network leg meanwhile
        elif gathered:
            self._gathered_allreduce(r, code, opc)
        else:
            try:
                req, w = self._post_allreduce(self._leaders, r, code, opc)
            except MPI.Exception as e:
                self._explain_mpi_error("all_reduce", e)
            self._wait([req], "all_reduce", r, w)
            wire.finish(r, w, code, opc, self._size)
        if plain:
            self._call(local.broadcast, recv, 0)
        else:
            self._call(local.broadcast, r, 0, dtype=code)
        return recv

    def _small_hot(self, h):
        """A small all-reduce of a remembered pair (h: SmallAllReduce): the same steps as the
        general path (host all-reduce, the leaders' (signature, host sum) all-gather, host
        broadcast) and the same checks, with everything per-pair resolved once."""
        local = self._local
        if local is None or self._closed_why is not None or self._outstanding is not None:
            self._begin(1)  # raises what a closed, broken or busy communicator raises
        comm = local._comm
        self._seq += 1
        rc = _c_allreduce(h.sp, h.rp, h.n, h.code, h.local_op, comm, _NULL)
        if rc:
            self._call(_check_rc, rc)
        leaders = self._leaders
        if leaders is None:
            rc = _c_expect_long_wait(comm)  # the leader is in the network leg meanwhile
            if rc:
                self._call(_check_rc, rc)
        else:
            h.sig[5] = self._seq
            self._mysig = h.sig
            np.copyto(h.block_data, h.r)
            try:
                req = leaders.Iallgather(h.send_spec, h.recv_spec)
            except MPI.Exception as e:
                self._explain_mpi_error("all_reduce", e)
            self._wait([req], "all_reduce", h.block, h.every)
            if self._check and h.every_sig.tobytes() != h.block_sig.tobytes() * len(h.rows):
                self._hot = _NO_HOT  # its buffers go with the failure
                self._sigs[...] = h.every_sig.view(np.int64)
                self._check_signatures()
            if len(h.rows) == 2:
                h.combine(h.rows[0], h.rows[1], out=h.r)
            else:
                h.combine.reduce(h.sums, axis=0, out=h.r)
            if h.avg:
                wire.finish(h.r, h.r, h.code, h.opc, self._size)
        rc = _c_broadcast(h.rp, h.rp, h.n, h.code, 0, comm, _NULL)
        if rc:
            self._call(_check_rc, rc)
        return h.recv

    def _gathered_allreduce(self, r, code, opc):
        """The leaders' leg of a small all-reduce as one MPI all-gather of (signature, host
        sum) blocks, each leader then combining the host sums in host order (the same bits
        on every leader).  One message exchange does the signature check and the data: a
        separate signature all-gather beside an all-reduce cost a second exchange (~20 us
        of ~60 over TCP here).  A block that differs in length (a count or type mismatch)
        still delivers its signature first to the leader with the longer block, and MPI
        reports truncation to the other, which then waits for that leader's notice."""
        nb = _SIG_BYTES + r.nbytes
        if self._gather_bufs is None or self._gather_bufs[0].size != nb:
            # kept between calls (small, and a fresh pair per call costs more than the copy);
            # after a failure they go with the abandoned request, and new ones are made
            self._gather_bufs = (np.empty(nb, np.uint8), np.empty((self._layout.nhosts, nb), np.uint8))
        block, every = self._gather_bufs
        if self._check:
            block[:_SIG_BYTES].view(np.int64)[...] = self._mysig
        block[_SIG_BYTES:] = r.view(np.uint8)
        try:
            req = self._leaders.Iallgather([block, MPI.BYTE], [every, MPI.BYTE])
        except MPI.Exception as e:
            self._explain_mpi_error("all_reduce", e)
        self._gather_bufs = None  # until the exchange completes: a failure abandons them with it
        self._wait([req], "all_reduce", block, every)
        self._gather_bufs = (block, every)
        if self._check and not (every[:, :_SIG_BYTES].view(np.int64) == self._mysig).all():
            self._sigs[...] = every[:, :_SIG_BYTES].view(np.int64)
            self._check_signatures()
        sums = every[:, _SIG_BYTES:].view(wire.STORAGE[code])
        if code in wire.HALF:
            sums = np.stack([wire.to_wire(row, code) for row in sums])
            w = _COMBINE[opc].reduce(sums, axis=0)
        else:
            w = r
            _COMBINE[opc].reduce(sums, axis=0, out=w)
        wire.finish(r, w, code, opc, self._size)

    def _large_allreduce(self, local, s, r, code, opc, local_op):
        n, per = s.size, self._per_rank
        shard = -(-n // self._nshards)
        blk_len = per * shard
        padded = self._lsize * blk_len
        if padded == n:
            src, dst = s, r
        else:  # pad to L blocks of c shards; the padding's values are never read back
            stage = np.zeros(padded, s.dtype)
            stage[:n] = s
            src = dst = stage
        blk = np.empty(blk_len, s.dtype)
        self._call(local.reduce_scatter, src, blk, local_op, dtype=code)
        reqs, parts = [], []
        try:
            for k, sh in enumerate(self._my_shards):
                part = blk[k * shard:(k + 1) * shard]
                req, w = self._post_allreduce(self._shard_comms[sh], part, code, opc)
                reqs.append(req)
                parts.append((part, w))
        except MPI.Exception as e:
            self._explain_mpi_error("all_reduce", e)
        self._wait(reqs, "all_reduce", blk, parts)
        for part, w in parts:
            wire.finish(part, w, code, opc, self._size)
        self._call(local.all_gather, blk, dst, dtype=code)
        if dst is not r:
            r[...] = dst[:n]

    def all_gather(self, send, recv=None, *, dtype=None, stream=None):
        """recv = every rank's send in world rank order; recv=None allocates (size, *send.shape)
        for a numpy send."""
        _no_stream(stream)
        s, code, _ks = wire.view(send, dtype, False, "send")
        if recv is None:
            if not isinstance(send, np.ndarray) or dtype is not None:
                raise KcclInvalidArgument("pass recv explicitly unless send is a numpy array and dtype is None")
            recv = np.empty((self._size,) + send.shape, send.dtype)
        r, rcode, _kr = wire.view(recv, dtype, True, "recv")
        if rcode != code:
            raise KcclInvalidArgument(f"send is {wire.type_name(code)} but recv is {wire.type_name(rcode)}")
        if r.size != s.size * self._size:
            raise KcclInvalidArgument(f"all_gather: recv has {r.size} elements, needs size*send = "
                                      f"{s.size * self._size}")
        local = self._begin(2, 0, code, s.size)
        nb = s.nbytes
        members = self._layout.members
        order = [w for m in members for w in m]  # gathered rows: host by host
        direct = order == list(range(self._size))
        gathered = r.view(np.uint8).reshape(self._size, nb) if direct else np.empty((self._size, nb), np.uint8)
        start = sum(self._layout.sizes[:self._host])
        mine = gathered[start:start + self._lsize]
        self._call(local.all_gather, s.view(np.uint8), mine.reshape(-1), dtype="uint8")
        if self._leaders is not None:
            counts = [len(m) * nb for m in members]
            displs = list(np.cumsum([0] + counts[:-1]))
            host_block = mine.copy()  # the send may not alias the receive buffer
            try:
                req = self._leaders.Iallgatherv([host_block, MPI.BYTE], [gathered, (counts, displs), MPI.BYTE])
            except MPI.Exception as e:
                self._explain_mpi_error("all_gather", e)
            self._wait([req], "all_gather", host_block, gathered)
        self._call(local.broadcast, gathered.reshape(-1), 0, dtype="uint8")
        if not direct:
            r.view(np.uint8).reshape(self._size, nb)[order] = gathered
        return recv

    def reduce_scatter(self, send, recv=None, op=wire.SUM, *, dtype=None, stream=None):
        """Rank r receives block r of the reduction of every rank's send (size equal blocks).
        Across hosts this is an all-reduce of the whole vector and a copy of this rank's
        block: correct, and N times the bytes a reduce-scatter needs on the inter-host leg."""
        _no_stream(stream)
        s, code, _ks = wire.view(send, dtype, False, "send")
        if s.size % self._size:
            raise KcclInvalidArgument(f"reduce_scatter: send has {s.size} elements, not a multiple of "
                                      f"size={self._size}")
        m = s.size // self._size
        if recv is None:
            if not isinstance(send, np.ndarray) or dtype is not None:
                raise KcclInvalidArgument("pass recv explicitly unless send is a numpy array and dtype is None")
            recv = np.empty(m, send.dtype)
        r, rcode, _kr = wire.view(recv, dtype, True, "recv")
        if rcode != code:
            raise KcclInvalidArgument(f"send is {wire.type_name(code)} but recv is {wire.type_name(rcode)}")
        if r.size != m:
            raise KcclInvalidArgument(f"reduce_scatter: recv has {r.size} elements, needs send/size = {m}")
        full = np.empty_like(s)
        self.all_reduce(s, full, op, dtype=code)
        r[...] = full[self._rank * m:(self._rank + 1) * m]
        return recv

    def broadcast(self, buf, root=0, *, dtype=None, stream=None):
        """root's buf is copied into every other rank's buf (in place): inside root's host,
        among the leaders, then inside every other host."""
        _no_stream(stream)
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise KcclInvalidArgument(f"root must be an int, got {type(root).__name__}")
        root = int(root)
        if not 0 <= root < self._size:
            raise KcclInvalidArgument(f"root {root} out of range for size={self._size}")
        b, code, _kb = wire.view(buf, dtype, True, "buf")
        local = self._begin(4, 0, code, b.size, root)
        rhost, rlocal = self._layout.host_of[root], self._layout.local_rank[root]
        if self._host == rhost:
            self._call(local.broadcast, b, rlocal, dtype=code)
        if self._leaders is not None:
            try:
                req = self._leaders.Ibcast([b.view(np.uint8), MPI.BYTE], root=rhost)
            except MPI.Exception as e:
                self._explain_mpi_error("broadcast", e)
            self._wait([req], "broadcast", b)
        if self._host != rhost:
            self._call(local.broadcast, b, 0, dtype=code)
        return buf

    def barrier(self, *, stream=None):
        """Returns once every rank of every host arrived."""
        _no_stream(stream)
        local = self._begin(5)
        self._call(local.barrier)
        if self._leaders is not None:
            try:
                req = self._leaders.Ibarrier()
            except MPI.Exception as e:
                self._explain_mpi_error("barrier", e)
            self._wait([req], "barrier")
        self._call(local.barrier)

    def all_reduce_start(self, send, recv=None, op=wire.SUM, *, dtype=None, stream=None):
        """Starts an all-reduce across hosts and returns a HierAllReduceHandle at once (see the
        module's text).  One may be outstanding at a time; a message holds at most
        KCCL_BUFFER_BYTES; send is copied before this returns."""
        _no_stream(stream)
        if recv is None:
            recv = send
        if self._outstanding is not None:
            raise KcclInvalidUsage("an all_reduce_start across hosts is already outstanding (one at a time): "
                                   "wait for it first")
        opc = _resolve_op(op)
        s, code, _ks = wire.view(send, dtype, recv is send, "send")
        if recv is send:
            r = s
        else:
            r, rcode, _kr = wire.view(recv, dtype, True, "recv")
            if rcode != code or r.size != s.size:
                raise KcclInvalidArgument("recv must have send's type and size")
        local = self._begin(6, opc, code, s.size)
        local_op = wire.SUM if opc == wire.AVG else opc
        h1 = self._call(local.all_reduce_start, s, r, local_op, dtype=code)
        handle = HierAllReduceHandle(self, h1, r, recv, code, opc)
        self._outstanding = handle
        return handle

    # -- life cycle -----------------------------------------------------------------
    def async_error(self):
        """None while usable, else the KcclError that broke the communicator."""
        if self._local is None:
            raise KcclInvalidUsage("communicator is closed")
        if self._closed_why is not None:
            return KcclRemoteError(self._closed_why)
        return self._local.async_error()

    def _release(self, abort):
        self._outstanding = None
        self._hot = _NO_HOT
        local, self._local = self._local, None
        if local is not None:
            local.abort() if abort else local.close()
        for req in getattr(self, "_notices", ()):
            try:
                if not req.Test():
                    _ABANDONED.append(req)
            except MPI.Exception:
                pass
        comms, self._comms = self._comms, []
        if abort:
            # after a failure, messages may still be in flight or unmatched on these
            # communicators; freed, their context ids would be reused by the next
            # communicator, whose receives could then match those stale messages
            _ABANDONED.append(comms)
            return
        for c in comms:
            try:
                c.Free()
            except MPI.Exception:
                pass

    def abort(self):
        """Immediate: every rank of every host blocked in a collective with this one raises
        KcclRemoteError naming it."""
        if self._local is not None and self._closed_why is None:
            try:
                self._fail(KcclRemoteError, f"rank {self._rank} (host {self._host}) aborted")
            except KcclRemoteError:
                pass
        self._closed_why = self._closed_why or "aborted"
        self._release(abort=True)

    def close(self):
        """Closes the host communicator and frees the inter-host MPI communicators (idempotent)."""
        if self._local is not None:
            self._release(abort=self._closed_why is not None)
            self._closed_why = self._closed_why or "closed"

    def __enter__(self):
        self._live()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()

    def __del__(self):
        if getattr(self, "_local", None) is not None and getattr(self, "_pid", None) == os.getpid():
            self.close()
