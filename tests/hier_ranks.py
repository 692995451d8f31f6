"""Runs under mpiexec for tests/test_hierarchical.py: one scenario per launch.

    python hier_ranks.py collectives CASES.json   every case against MPI on the same inputs
    python hier_ranks.py kill VICTIM              VICTIM exits before an all_reduce (HIER_VICTIM=silent:
                                                  stops answering instead, exits once the others reported)
    python hier_ranks.py failures                 mismatches, an MPI error, abort, unequal settings
    python hier_ranks.py layout                   what MPICH and KCCL think the hosts are

HIER_HOSTS=k sets KCCL_HOST_ID to "sim<rank % k>" (MPICH's MPIR_CVAR_NUM_CLIQUES=k groups
ranks the same way); without it KCCL_HOST_ID comes from the launcher (mpiexec -env).
Rank 0 prints one line "RESULT <json>" with what every rank saw."""
import json
import os
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

from _mpi_shm import forget_mpi_segments

world = MPI.COMM_WORLD
RANK, SIZE = world.Get_rank(), world.Get_size()
if os.environ.get("HIER_HOSTS"):
    os.environ["KCCL_HOST_ID"] = f"sim{RANK % int(os.environ['HIER_HOSTS'])}"

import kccl  # noqa: E402  (after KCCL_HOST_ID is set)

DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64"]
OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN, "avg": MPI.SUM}


def report(payload):
    every = world.gather(payload, root=0)
    if RANK == 0:
        print("RESULT " + json.dumps(every), flush=True)


# -- inputs and MPI's answers -------------------------------------------------------------
def storage(dtype):
    return np.uint16 if dtype == "bfloat16" else np.dtype(dtype)


def to_bf16_bits(f32):
    """Round to nearest even; a NaN stays a (quiet) NaN."""
    u = np.asarray(f32, np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def values(case, rank, count):
    """This rank's input as float64 values: small integers (exact in every type and any
    summation order) or, for "normal", random floats."""
    rng = np.random.default_rng([case["seed"], rank])
    if case.get("values") == "normal":
        return rng.standard_normal(count)
    unsigned = case["dtype"].startswith("u")
    lo, hi = (0, 3) if case["op"] == "prod" else (0, 7)
    if not unsigned:
        lo, hi = (-2, 3) if case["op"] == "prod" else (-3, 4)
    return rng.integers(lo, hi, count).astype(np.float64)


def encode(v, dtype):
    if dtype == "bfloat16":
        return to_bf16_bits(v)
    return v.astype(dtype)


def mpi_allreduce(v, case):
    """MPI_Allreduce's answer on the same inputs (half types through float32, AVG = SUM then
    a division by the world size, truncating toward zero for integers)."""
    dtype, op = case["dtype"], case["op"]
    wire = v.astype(np.float32) if dtype in ("float16", "bfloat16") else v.astype(dtype)
    out = np.empty_like(wire)
    world.Allreduce(wire, out, op=OPS[op])
    if op == "avg":
        if out.dtype.kind == "f":
            out = out / out.dtype.type(SIZE)
        else:
            out = np.trunc(out.astype(np.float64) / SIZE).astype(out.dtype)
    if dtype == "bfloat16":
        return to_bf16_bits(out)
    return out.astype(dtype)


def same(mine, ref, case):
    if case.get("values") == "normal":
        tol = 1e-4 if case["dtype"] == "float32" else 1e-10
        return np.allclose(mine.astype(np.float64), ref.astype(np.float64), rtol=tol, atol=tol)
    return mine.tobytes() == ref.tobytes()


def run_case(comm, case):
    """(KCCL's result, MPI's result) of one case on this rank."""
    coll, dtype, count = case["coll"], case["dtype"], case["count"]
    kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    if coll in ("all_reduce", "all_reduce_start", "all_reduce_inplace"):
        v = values(case, RANK, count)
        x = encode(v, dtype)
        ref = mpi_allreduce(v, case)
        if coll == "all_reduce_inplace":
            comm.all_reduce(x, op=case["op"], **kw)
            return x, ref
        if coll == "all_reduce":
            return comm.all_reduce(x, np.empty_like(x), op=case["op"], **kw), ref
        h = comm.all_reduce_start(x, np.empty_like(x), op=case["op"], **kw)
        x[...] = 0  # the start copied send
        spins = 0
        while not h.test():
            spins += 1
        return h.wait(), ref
    if coll == "reduce_scatter":
        v = values(case, RANK, count * SIZE)
        out = comm.reduce_scatter(encode(v, dtype), np.empty(count, storage(dtype)), op=case["op"], **kw)
        return out, mpi_allreduce(v, case)[RANK * count:(RANK + 1) * count]
    if coll == "all_gather":
        x = encode(values(case, RANK, count), dtype)
        ref = np.empty(count * SIZE, x.dtype)
        world.Allgather(x, ref)
        return comm.all_gather(x, np.empty(count * SIZE, x.dtype), **kw), ref
    if coll == "broadcast":
        x = encode(values(case, RANK, count), dtype)
        ref = x.copy()
        world.Bcast(ref, root=case["root"] % SIZE)
        return comm.broadcast(x, root=case["root"] % SIZE, **kw), ref
    if coll == "barrier":
        comm.barrier()
        return np.zeros(0), np.zeros(0)
    raise ValueError(coll)


def collectives(path):
    with open(path) as f:
        cases = json.load(f)
    comm = kccl.Communicator.from_mpi(world)
    problems, digests = [], []
    for i, case in enumerate(cases):
        mine, ref = run_case(comm, case)
        if not same(mine, ref, case):
            problems.append(f"case {i} {case}: kccl {mine[:6].tolist()} mpi {ref[:6].tolist()}")
        digests.append(zlib.crc32(mine.tobytes()) if case["coll"] != "reduce_scatter" else 0)
    every = world.allgather(digests)  # every rank got the same bits
    for i, case in enumerate(cases):
        if len({d[i] for d in every}) != 1:
            problems.append(f"case {i} {case}: ranks disagree")
    info = comm.topo_info()
    comm.close()
    report({"problems": problems, "hosts": info["hosts"], "host": info["host"], "type": type(comm).__name__,
            "cases": len(cases)})


# -- failures -------------------------------------------------------------------------------
def outcome(fn):
    """(exception class name, text, seconds) of fn(), or ("ok", "", seconds)."""
    t0 = time.monotonic()
    try:
        fn()
        return ["ok", "", time.monotonic() - t0]
    except kccl.KcclError as e:
        return [type(e).__name__, str(e), time.monotonic() - t0]


def _stay_silent(victim):
    """The victim stops answering but stays alive until every other rank has reported (60 s
    at most): to the others it is gone as a dead rank is, but MPI, which may crash in a call
    that reaches a dead rank, cannot end the run before they report."""
    out = os.environ["HIER_OUT"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(out, f"rank{r}.json")) for r in range(SIZE) if r != victim):
            return
        time.sleep(0.05)


def kill(victim):
    comm = kccl.Communicator.from_mpi(world)
    x = np.ones(int(os.environ.get("HIER_COUNT", "100")), np.float32)
    comm.all_reduce(x)  # everyone is in and working
    world.Barrier()
    # every rank has attached MPICH's segments, and no rank here reaches MPI_Finalize
    with open(os.path.join(os.environ["HIER_OUT"], f"mpi_shm{RANK}.json"), "w") as f:
        json.dump(forget_mpi_segments(), f)
    if RANK == victim:
        if os.environ.get("HIER_VICTIM") == "silent":
            _stay_silent(victim)
        os._exit(3)
    got = outcome(lambda: comm.all_reduce(x))
    after = outcome(lambda: comm.all_reduce(x))
    comm.close()
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith("kccl-"))
    # a file per rank: no collective with a dead rank, no lines interleaved on stdout
    path = os.path.join(os.environ["HIER_OUT"], f"rank{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": RANK, "first": got, "after": after, "shm": left}, f)
    os.rename(path + ".tmp", path)  # whole or absent, even if the launcher kills this rank
    os._exit(0)  # MPI_Finalize would wait for the dead rank


class BrokenLink:
    """A leaders communicator whose next inter-host all-reduce fails as MPI would (the small
    all-reduce's leg is an all-gather of signature and data, the others an all-reduce)."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Iallreduce(self, *args, **kw):
        raise MPI.Exception(MPI.ERR_OTHER)

    Iallgather = Iallreduce


def failures():
    seen = {}
    host = None

    def scenario(name, body, config=None):
        world.Barrier()
        try:
            comm = kccl.Communicator.from_mpi(world, config=config)
        except kccl.KcclError as e:
            seen[name] = [[type(e).__name__, str(e), 0.0]]
            return
        seen[name] = [outcome(lambda: body(comm))]
        seen[name].append(outcome(lambda: comm.all_reduce(np.ones(3, np.float32))))  # broken for good
        comm.close()

    def host_of(comm):
        return comm.topo_info()["host"]

    scenario("count", lambda c: c.all_reduce(np.ones(10 + host_of(c), np.float32)))
    scenario("op", lambda c: c.all_reduce(np.ones(10, np.float32), op="max" if host_of(c) else "sum"))
    scenario("kind", lambda c: c.all_reduce(np.ones(4, np.float32)) if host_of(c) == 0
             else c.broadcast(np.ones(4, np.float32), root=0))
    scenario("dtype", lambda c: c.all_reduce(np.ones(8, np.float32 if host_of(c) else np.int32)))
    scenario("large_count", lambda c: c.all_reduce(np.ones(20000 + 4 * host_of(c), np.float32)),
             config={"hier_large_bytes": 4096})

    def hot(c, last):  # the remembered small pair (HierarchicalCommunicator._small_hot), then a mismatch
        x = np.ones(10, np.float32)
        for _ in range(3):
            c.all_reduce(x)
        last(c, x)
    scenario("hot_op", lambda c: hot(c, lambda c, x: c.all_reduce(x, op=kccl.MAX if host_of(c) else kccl.SUM)))
    scenario("hot_kind", lambda c: hot(c, lambda c, x: c.all_reduce(x) if host_of(c) == 0 else c.broadcast(x, 0)))

    def mpi_error(c):
        if c.rank == 1:  # host 1's leader
            c._leaders = BrokenLink(c._leaders)
        c.all_reduce(np.ones(10, np.float32))
    scenario("mpi_error", mpi_error)

    def aborted(c):
        if c.rank == SIZE - 1:
            time.sleep(0.2)
            c.abort()
            return
        c.all_reduce(np.ones(10, np.float32))
    scenario("abort", aborted)
    scenario("settings", lambda c: None, config={"hier_large_bytes": 4096 if RANK == 0 else 8192})
    world.Barrier()
    seen["shm"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("kccl-"))
    report(seen)


def layout():
    """MPICH's idea of the hosts (the ranks it lets share memory) beside KCCL's."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    mpi_peers = node.allgather(RANK)
    comm = kccl.Communicator.from_mpi(world)
    info = comm.topo_info()
    comm.close()
    report({"mpi_node": sorted(mpi_peers), "host": info.get("host"), "hosts": info.get("hosts")})


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "collectives":
        collectives(sys.argv[2])
    elif what == "kill":
        kill(int(sys.argv[2]))
    elif what == "failures":
        failures()
    elif what == "layout":
        layout()
    else:
        sys.exit(f"unknown scenario {what}")
