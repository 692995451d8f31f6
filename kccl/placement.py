"""This rank's placement for the host transport: topology/ finds the domains
(L3 x NUMA node) and the one this rank runs in; the result goes to C as a
kcclPlacement_t (kcclCommInitRankPlacement).

KCCL_TOPO=off, a machine with one domain, or a live discovery that fails
(an odd container's sysfs) mean one copy of everything; a KCCL_TOPO_FILE that
cannot be read is an error, since someone asked for it."""
import hashlib
import json
import os

from .errors import KcclInvalidArgument

_live = None  # this machine's topology, read once per process (it does not change)


def _live_topology():
    global _live
    if _live is None:
        import topology
        _live = topology.discover("/", live_gpus=False)
    return _live


def domain_hash(domains):
    """64 bits naming a domain list: ranks that disagree on it cannot share replicas."""
    text = json.dumps([[d.key, d.numa, sorted(d.cpus)] for d in domains])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def resolve(nranks, rank, mode, path):
    """(ndomains, domain, [numa per domain], hash, note) for this rank."""
    if mode == "off":
        return 1, 0, [], 0, "KCCL_TOPO=off"
    try:
        import topology
    except ModuleNotFoundError as e:  # kccl installed without topology/: nothing to place with
        if e.name != "topology":
            raise
        return 1, 0, [], 0, "topology package not installed"
    rank_domains = None
    if path:
        try:
            topo, rank_domains = topology.load(path)
        except topology.TopologyError as e:
            raise KcclInvalidArgument(f"KCCL_TOPO_FILE={path!r}: {e}") from None
    else:
        try:
            topo = _live_topology()
        except topology.TopologyError as e:
            return 1, 0, [], 0, f"discovery failed ({e}): one copy"
    domains = topo.cpu_domains()
    if len(domains) <= 1:
        return 1, 0, [], 0, "one domain: one copy"
    if len(domains) > 64:  # KCCL_MAX_DOMAINS
        return 1, 0, [], 0, f"{len(domains)} domains exceed KCCL_MAX_DOMAINS (64): one copy"
    if rank_domains is not None:
        if len(rank_domains) != nranks:
            raise KcclInvalidArgument(f"KCCL_TOPO_FILE={path!r} pins {len(rank_domains)} ranks (rank_domains), "
                                      f"the communicator has {nranks}")
        mine = rank_domains[rank]
    else:
        where = topo.cpu_to_domain()
        ds = {where[c] for c in os.sched_getaffinity(0) if c in where}
        mine = ds.pop() if len(ds) == 1 else -1
    numa = [-1 if d.numa is None else d.numa for d in domains]
    return len(domains), mine, numa, domain_hash(domains), f"domain {mine} of {len(domains)}"


def native(ffi, nranks, rank, mode, path):
    """(kcclPlacement_t*, why: the plan in words, for topo_info())."""
    return _fill(ffi, *resolve(nranks, rank, mode, path))


def one_copy(ffi, note):
    return _fill(ffi, 1, 0, [], 0, note)


def _fill(ffi, nd, mine, numa, h, note):
    pl = ffi.new("kcclPlacement_t *")
    pl.size = ffi.sizeof("kcclPlacement_t")
    pl.ndomains = nd
    pl.domain = mine
    for i in range(64):
        pl.numaNode[i] = numa[i] if i < len(numa) else -1
    pl.topoHash = h
    return pl, note
