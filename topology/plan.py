"""Placement plans: for a communicator's ranks, the domains they span, the
ranks in each, and where each replica of each rank's flags and small-message
slots lives.  The rule (kccl_native/src/replicas.c implements the same):

  * a rank's domain: host ranks by their CPUs' (L3, NUMA) domain (a rank whose
    CPUs span several domains has none: it reads writers' own copies); GPU
    ranks by their GPU;
  * writer w keeps its own copy in its domain (read there, and by domain-less
    ranks) and writes one replica into every other domain holding a rank;
  * a reader polls the copy in its own domain.  One domain = one copy.

Inside one GPU the chip model adds copies (one per L2 partition on H100/H200,
one per IOD on MI300X), listed as `sub` on the GPU's replica: that part is a
plan for the GPU transport, not something the host transport does."""
from dataclasses import dataclass, field
from typing import List, Optional

from . import chips
from .errors import TopologyError


@dataclass
class PlanDomain:
    index: int            # the machine's domain number (what KCCL's C side is given)
    key: str              # "l3:3/numa:1", "gpu:2"
    numa: Optional[int]   # node its replica pages are bound to
    ranks: List[int]


@dataclass
class Replica:
    domain: Optional[int]  # None: the writer's own copy of a domain-less writer
    numa: Optional[int]
    readers: List[int]
    own: bool              # the writer's own copy (lives in its segment's main slots)
    sub: List[str] = field(default_factory=list)  # copies inside a GPU (chip model)


@dataclass
class Plan:
    nranks: int
    kind: str                       # "cpu" or "gpu"
    domains: List[PlanDomain]       # the domains holding ranks
    rank_domain: List[Optional[int]]
    replicas: List[List[Replica]]   # per writer
    machine_domains: int            # domains the machine has (spanned or not)
    oversubscribed: int = 0         # ranks placed on a CPU an earlier rank already has

    @property
    def copies_per_flag(self):
        return max(len(r) for r in self.replicas) if self.replicas else 0

    @property
    def single_copy(self):
        return self.copies_per_flag <= 1

    def to_dict(self):
        return {"nranks": self.nranks, "kind": self.kind, "machine_domains": self.machine_domains,
                "single_copy": self.single_copy, "oversubscribed": self.oversubscribed,
                "domains": [{"index": d.index, "key": d.key, "numa": d.numa, "ranks": d.ranks} for d in self.domains],
                "rank_domain": self.rank_domain,
                "replicas": [[{"domain": r.domain, "numa": r.numa, "readers": r.readers, "own": r.own, "sub": r.sub}
                              for r in reps] for reps in self.replicas]}

    def describe(self):
        lines = [f"plan for {self.nranks} {self.kind} ranks: {len(self.domains)} of {self.machine_domains} "
                 f"domains spanned, {self.copies_per_flag} cop{'y' if self.copies_per_flag == 1 else 'ies'} "
                 f"of each flag" + (" (one domain: one copy)" if self.single_copy else "")]
        if self.oversubscribed:
            lines.append(f"  oversubscribed: {self.nranks} ranks on {self.nranks - self.oversubscribed} CPUs, "
                         f"dealt round-robin (a rank takes the domain of the CPU it shares)")
        for d in self.domains:
            lines.append(f"  domain {d.index:>3} {d.key:<22} numa {d.numa if d.numa is not None else '-':>3}  "
                         f"ranks {list_text(d.ranks)}")
        loose = [r for r, d in enumerate(self.rank_domain) if d is None]
        if loose:
            lines.append(f"  no domain (CPUs span several; read writers' own copies): ranks {list_text(loose)}")
        w = 0
        reps = self.replicas[w]
        lines.append(f"  rank {w}'s flags: " + "; ".join(
            f"{'own copy' if r.own else 'replica'} in domain {r.domain} read by {list_text(r.readers) or 'nobody'}"
            + (f" [{', '.join(r.sub)}]" if r.sub else "") for r in reps))
        return "\n".join(lines)


def list_text(xs):
    """Integers in the kernel's cpulist format: [0, 1, 2, 5] -> "0-2,5"."""
    xs = sorted(xs)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


MAX_RANKS = 1024  # KCCL_MAX_RANKS (kccl_native/src/internal.h): the largest communicator


def compact_cpus(topo, n):
    """n ranks one per core in CPU order (then on SMT siblings): what `--bind-to core` gives.
    More ranks than CPUs are dealt round-robin over the same order: KCCL runs such
    communicators (its waits yield the CPU when ranks outnumber cores), and a rank's domain
    is the domain of the CPU it shares."""
    if not 1 <= n <= MAX_RANKS:
        raise TopologyError(f"{n} ranks: a KCCL communicator holds 1..{MAX_RANKS} ranks")
    cores = sorted(topo.of_kind("core"), key=lambda c: min(c.attrs["cpus"]))
    order = [min(c.attrs["cpus"]) for c in cores]
    order += sorted(cpu for c in cores for cpu in c.attrs["cpus"] if cpu != min(c.attrs["cpus"]))
    if not order:
        raise TopologyError("the topology has no CPUs")
    return [order[i % len(order)] for i in range(n)]


def cpu_count(topo):
    return sum(len(c.attrs["cpus"]) for c in topo.of_kind("core"))


def _check_count(n):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TopologyError(f"rank count must be a positive int, got {n!r}")


def plan(ranks, topo, rank_domains=None):
    """ranks: a rank count (one rank per core, compact), a list of CPU numbers or CPU
    sets (one per rank), or a list of "gpu:<i>" (GPU ranks).  rank_domains: the
    domain of each rank, overriding where its CPUs are (topology files for tests)."""
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        _check_count(ranks)
        ranks = compact_cpus(topo, ranks)  # round-robin beyond the CPUs: see Plan.oversubscribed
    if not isinstance(ranks, (list, tuple)) or not ranks:
        raise TopologyError(f"ranks must be a positive count or a non-empty list, got {ranks!r}")
    if all(isinstance(r, str) for r in ranks):
        return _gpu_plan(list(ranks), topo)
    domains = topo.cpu_domains()
    if not domains:
        raise TopologyError("the topology has no cores")
    where = topo.cpu_to_domain()
    rank_domain: List[Optional[int]] = []
    for i, r in enumerate(ranks):
        cpus = {r} if isinstance(r, int) and not isinstance(r, bool) else set(r) if isinstance(r, (set, frozenset, list, tuple)) else None
        if not cpus or not all(isinstance(c, int) and c in where for c in cpus):
            raise TopologyError(f"rank {i}: {r!r} is not a CPU (or set of CPUs) of this topology")
        ds = {where[c] for c in cpus}
        rank_domain.append(ds.pop() if len(ds) == 1 else None)
    if rank_domains is not None:
        if len(rank_domains) != len(ranks):
            raise TopologyError(f"rank_domains lists {len(rank_domains)} ranks, the communicator has {len(ranks)}")
        rank_domain = [None if d is None or d < 0 else int(d) for d in rank_domains]
        if any(d is not None and d >= len(domains) for d in rank_domain):
            raise TopologyError(f"rank_domains names a domain beyond the {len(domains)} of this topology")
    p = _build(len(ranks), "cpu", rank_domain, {d.index: (d.key, d.numa) for d in domains}, len(domains), {})
    singles = [r for r in ranks if isinstance(r, int)]
    p.oversubscribed = len(singles) - len(set(singles))
    return p


def _gpu_plan(ranks, topo):
    gpus = {n.id: n for n in topo.of_kind("gpu")}
    if not gpus:
        raise TopologyError("GPU ranks given but the topology has no GPUs")
    ids = sorted(gpus, key=lambda g: int(g.split(":")[1]))
    index = {g: i for i, g in enumerate(ids)}
    rank_domain = []
    for i, r in enumerate(ranks):
        if r not in index:
            raise TopologyError(f"rank {i}: {r!r} is not a GPU of this topology ({', '.join(ids)})")
        rank_domain.append(index[r])
    info, subs = {}, {}
    for g in ids:
        a = gpus[g].attrs
        info[index[g]] = (g, a.get("numa"))
        model = chips.MODELS.get(a.get("model") or "")
        if model and model.die_groups:
            subs[index[g]] = [f"iod:{i} (XCDs {','.join(map(str, grp))})" for i, grp in enumerate(model.die_groups)]
        elif model and model.l2_partitions > 1:
            subs[index[g]] = [f"l2p:{p} (its near SMs: measured)" for p in range(model.l2_partitions)]
    return _build(len(ranks), "gpu", rank_domain, info, len(ids), subs)


def _build(n, kind, rank_domain, info, machine_domains, subs):
    spanned = sorted({d for d in rank_domain if d is not None})
    doms = [PlanDomain(d, info[d][0], info[d][1], [r for r in range(n) if rank_domain[r] == d]) for d in spanned]
    replicas = []
    for w in range(n):
        dw = rank_domain[w]
        own_readers = [r for r in range(n) if r != w and (rank_domain[r] == dw or rank_domain[r] is None)]
        reps = [Replica(dw, info[dw][1] if dw is not None else None, own_readers, True, subs.get(dw, []))]
        for d in spanned:
            if d != dw:
                reps.append(Replica(d, info[d][1], [r for r in range(n) if rank_domain[r] == d], False,
                                    subs.get(d, [])))
        replicas.append(reps)
    return Plan(n, kind, doms, rank_domain, replicas, machine_domains)
