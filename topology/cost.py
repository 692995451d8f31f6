"""Cost model: cross-domain cache-line transfers of one one-shot all-reduce.

In a one-shot all-reduce every rank writes its slot (flag + data: L lines) and
reads every peer's.  Counted per writer w and per line:

  single copy   every reader outside w's domain fetches the line from w's cache:
                one transfer per such reader (readers poll at once, after w's
                store invalidated them, so each miss is served on its own);
  replicated    (KCCL's replicas: remote copies written with non-temporal
                stores) w sends the line once into each other domain holding
                readers; those readers refill from their own domain: one
                transfer per remote domain;
  replicated with plain stores (for comparison, not what KCCL does): the line
                stays in w's cache, so each remote domain costs w's fetch of
                the line (its ownership) plus every reader's fetch back.

A reader with no domain (CPUs spanning several) reads w's own copy and counts
as remote in every model.  Payloads above REPLICA_DATA_MAX (16 KB, as in
kccl_native/src/replicas.c) are not replicated at all (the reader fetches the
writer's first line with the data anyway, so a flag replica would only add a
transfer): there both plans cost the same.  Polling while the flag is unchanged costs nothing
(the line stays shared in the readers' caches); invalidations and the writer's
own copy are not counted."""
from .plan import MAX_RANKS, plan as make_plan, compact_cpus
from .errors import TopologyError

LINE = 64
FLAG_BYTES = 8
REPLICA_DATA_MAX = 16384


def lines_of(message_bytes):
    if message_bytes < 0:
        raise TopologyError(f"message size {message_bytes} < 0")
    return -(-(FLAG_BYTES + message_bytes) // LINE)


def transfers(p, message_bytes=8):
    """{"single": n, "replicated": n, "replicated_plain_stores": n} for plan p."""
    L = lines_of(message_bytes)
    dom = p.rank_domain
    replicated = message_bytes <= REPLICA_DATA_MAX
    single = repl = plain = 0
    for w, reps in enumerate(p.replicas):
        dw = dom[w]
        single += sum(1 for r in range(p.nranks) if r != w and (dom[r] is None or dom[r] != dw))
        own = reps[0]
        loose = sum(1 for r in own.readers if dom[r] is None or dom[r] != dw)  # domain-less readers
        remote = [x for x in reps[1:] if x.readers]
        if replicated:
            repl += len(remote) + loose
            plain += sum(1 + len(x.readers) for x in remote) + loose
        else:  # one copy for large payloads
            n_remote = sum(1 for r in range(p.nranks) if r != w and (dom[r] is None or dom[r] != dw))
            repl += n_remote
            plain += n_remote
    return {"single": single * L, "replicated": repl * L, "replicated_plain_stores": plain * L}


def scatter_cpus(topo, n):
    """n ranks dealt round-robin over the domains (one core each): the worst case for one copy.
    Beyond one rank per core the deal starts again from the first cores (oversubscribed)."""
    doms = [sorted({min(c.attrs["cpus"]) for c in topo.of_kind("core") if set(c.attrs["cpus"]) <= d.cpus})
            for d in topo.cpu_domains()]
    order, i = [], 0
    while any(doms):
        if doms[i % len(doms)]:
            order.append(doms[i % len(doms)].pop(0))
        i += 1
    if not order:
        raise TopologyError("the topology has no cores")
    if not 1 <= n <= MAX_RANKS:
        raise TopologyError(f"{n} ranks: a KCCL communicator holds 1..{MAX_RANKS} ranks")
    return [order[k % len(order)] for k in range(n)]


def table(topo, counts, message_bytes=8, placement="compact"):
    """A row for every rank count asked for; counts above the machine's cores (compact:
    its CPUs) share cores round-robin, as plan() places them, and say so ("shared")."""
    rows = []
    for n in counts:
        cpus = compact_cpus(topo, n) if placement == "compact" else scatter_cpus(topo, n)
        p = make_plan(cpus, topo)
        t = transfers(p, message_bytes)
        rows.append({"ranks": n, "domains": len(p.domains), "copies": p.copies_per_flag, **t,
                     "ratio": (t["single"] / t["replicated"]) if t["replicated"] else None,
                     "shared": len(cpus) - len(set(cpus))})
    return rows


def format_table(name, rows, message_bytes=8, placement="compact"):
    out = [f"{name}: {message_bytes}-byte one-shot all-reduce ({lines_of(message_bytes)} line(s)/slot), "
           f"{placement} placement",
           f"{'ranks':>5} {'domains':>7} {'single copy':>12} {'replicated':>11} {'single/repl':>11} "
           f"{'repl, plain stores':>18}"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        mark = " *" if r.get("shared") else ""
        out.append(f"{r['ranks']:>5} {r['domains']:>7} {r['single']:>12} {r['replicated']:>11} {ratio:>11} "
                   f"{r['replicated_plain_stores']:>18}{mark}")
    if any(r.get("shared") for r in rows):
        out.append("* more ranks than CPUs: ranks share CPUs round-robin (oversubscribed)")
    return "\n".join(out)
