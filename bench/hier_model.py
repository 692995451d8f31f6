"""An alpha-beta cost model of the hierarchical all-reduce (KCCL inside hosts, MPI/NCCL
between them) against a flat one, predicting 2 to 64 hosts, and its check against the
one-machine simulation (bench/hier_allreduce.py's JSON).

    python bench/hier_model.py --check bench/results/hier_allreduce_2x2_quiet.json --json bench/results/hier_model.json

Every hop costs alpha + bytes / bandwidth.  Collectives, for m bytes:
  inside a host of L ranks (KCCL): all-reduce one-shot alpha + (L-1) m / bw up to the
    one-shot limit, else two-shot 2 alpha + 2 (L-1)/L m / bw; broadcast alpha + m / bw;
    reduce-scatter and all-gather alpha + (L-1)/L m / bw each.
  between H hosts: the better of recursive doubling, ceil(log2 H) (alpha + m / bw), and a
    ring, 2 (H-1) alpha + 2 (H-1)/H m / bw (what MPI and NCCL pick between).
  hierarchical small: all-reduce inside + between the H leaders + broadcast inside.
  hierarchical large: reduce-scatter inside + L concurrent all-reduces of m/L between hosts
    (each gets bw / L when the host has one NIC, bw when it has a NIC per rank) + all-gather.
  flat (ranks in host blocks, topology-unaware): the better of recursive doubling over
    N = H L ranks (log2 L steps stay inside a host, log2 H cross) and a ring over N ranks
    (2 (N-1) steps, each as slow as its network hop: alpha_net + m/N / bw_net).
Link figures are assumptions of the usual order (named in LINKS), not measurements; the
simulation check fits this machine's own figures from the benchmark's legs instead."""
import argparse
import json
import math
import sys

# name: (alpha seconds, bandwidth bytes/s, gap seconds), per hop, as seen by one rank; gap: what
# each further message costs when several ranks' flows share one NIC in the same step
LINKS = {
    "shm": (0.7e-6, 10e9, 0.0),       # KCCL host transport: ~0.7 us small all-reduce (RESULTS), memcpy-class bw
    "nvlink": (3.5e-6, 350e9, 0.0),   # KCCL GPU one-shot ~3.4 us at 8 ranks in a graph (RESULTS); NVLink 4 per-GPU bw
    "net100": (3e-6, 12.5e9, 0.2e-6),  # RDMA NIC, 100 Gb/s
    "net200": (3e-6, 25e9, 0.2e-6),
    "net400": (3e-6, 50e9, 0.2e-6),
    "tcp25": (25e-6, 3.1e9, 5e-6),    # kernel TCP over a 25 Gb/s NIC (a send is a system call)
}
# (label, intra link, inter link, ranks per host, NICs per host)
SYSTEMS = [
    ("CPU hosts, 8 ranks, 25 Gb/s TCP", "shm", "tcp25", 8, 1),
    ("CPU hosts, 8 ranks, 100 Gb/s RDMA", "shm", "net100", 8, 1),
    ("GPU hosts, 8 GPUs, 200 Gb/s x 8 rails", "nvlink", "net200", 8, 8),
    ("GPU hosts, 8 GPUs, 400 Gb/s x 8 rails", "nvlink", "net400", 8, 8),
    ("GPU hosts, 8 GPUs, 400 Gb/s x 1", "nvlink", "net400", 8, 1),
]
HOSTS = [2, 4, 8, 16, 32, 64]
SIZES = [4, 4096, 65536, 1 << 20, 16 << 20, 64 << 20]
ONESHOT_MAX = 16 * 1024  # KCCL_ONESHOT_MAX_BYTES


def hop(link, m):
    a, bw = link[:2]
    return a + m / bw


def intra_allreduce(link, L, m):
    if L == 1:
        return 0.0
    a, bw = link[:2]
    if m <= ONESHOT_MAX:
        return a + (L - 1) * m / bw
    return 2 * a + 2 * (L - 1) / L * m / bw


def intra_part(link, L, m):  # reduce-scatter or all-gather
    return 0.0 if L == 1 else link[0] + (L - 1) / L * m / link[1]


def intra_bcast(link, L, m):
    return 0.0 if L == 1 else hop(link, m)


def inter_allreduce(link, H, m):
    if H == 1:
        return 0.0
    a, bw = link[:2]
    rd = math.ceil(math.log2(H)) * (a + m / bw)
    ring = 2 * (H - 1) * a + 2 * (H - 1) / H * m / bw
    return min(rd, ring)


def hier_small(intra, inter, H, L, m):
    return intra_allreduce(intra, L, m) + inter_allreduce(inter, H, m) + intra_bcast(intra, L, m)


def hier_large(intra, inter, H, L, m, nics):
    a, bw, gap = inter
    share = math.ceil(L / nics)  # flows through one NIC at once
    per_flow = (a + (share - 1) * gap, bw / share)
    return 2 * intra_part(intra, L, m) + inter_allreduce(per_flow, H, m / L)


def flat(intra, inter, H, L, m):
    N = H * L
    rd = math.ceil(math.log2(L)) * hop(intra, m) + math.ceil(math.log2(H)) * hop(inter, m) if L > 1 else \
        math.ceil(math.log2(H)) * hop(inter, m)
    ring = 2 * (N - 1) * hop(inter, m / N)
    return min(rd, ring)


def predict():
    out = []
    for label, il, nl, L, nics in SYSTEMS:
        intra, inter = LINKS[il], LINKS[nl]
        for H in HOSTS:
            for m in SIZES:
                s, lg = hier_small(intra, inter, H, L, m), hier_large(intra, inter, H, L, m, nics)
                f = flat(intra, inter, H, L, m)
                out.append({"system": label, "hosts": H, "per_host": L, "bytes": m, "hier_small_us": s * 1e6,
                            "hier_large_us": lg * 1e6, "hier_us": min(s, lg) * 1e6,
                            "path": "small" if s <= lg else "large", "flat_us": f * 1e6,
                            "flat_over_hier": f / min(s, lg)})
    return out


def crossover(label):
    """The smallest size from which the large path wins, per host count (bytes, 4 B steps x2)."""
    _, il, nl, L, nics = next(s for s in SYSTEMS if s[0] == label)
    res = {}
    for H in HOSTS:
        m = 64
        intra, inter = LINKS[il], LINKS[nl]
        while m < (1 << 30) and hier_small(intra, inter, H, L, m) <= hier_large(intra, inter, H, L, m, nics):
            m *= 2
        res[H] = m
    return res


# -- the check against the one-machine simulation ------------------------------------------------
def fit(points):
    """(alpha s, bandwidth B/s) minimizing the relative error of alpha + m / bw over (m, t) points."""
    import numpy as np
    m = np.array([p[0] for p in points], float)
    t = np.array([p[1] for p in points], float)
    A = np.stack([1 / t, m / t], 1)
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    a, b = max(a, 0.0), max(b, 1e-15)
    return a, 1 / b


def check(path):
    with open(path) as f:
        data = json.load(f)
    meta, rows = data["meta"], data["rows"]
    H, L, large = meta["hosts"], meta["per_host"], meta["large_bytes"]
    med = {k: [(r["bytes"], r["stats"][k][1] * 1e-6) for r in rows] for k in rows[0]["stats"]}
    # the simulated links, from the legs measured in the same run
    shm = fit([(m, t) for m, t in med["kccl_bcast"]])
    net = fit(med["mpi_leaders"])
    shard_net = fit([(m / L, t) for m, t in med["mpi_shards"]])  # L flows at once on this machine
    out = []
    for r in rows:
        m = r["bytes"]
        s = r["stats"]
        gathered = "mpi_gather" in s and m * (H - 1) <= meta.get("gather_max_bytes", -1)
        leaders_leg = s["mpi_gather"][1] if gathered else s["mpi_leaders"][1]
        legs = (s["kccl_local"][1] + leaders_leg + s["kccl_bcast"][1]) if m < large else \
            (s["kccl_rs_ag"][1] + s["mpi_shards"][1])
        if m < large:
            model = intra_allreduce(shm, L, m) + inter_allreduce(net, H, m) + intra_bcast(shm, L, m)
        else:
            model = 2 * intra_part(shm, L, m) + inter_allreduce(shard_net, H, m / L)
        out.append({"bytes": m, "measured_us": s["hier"][1], "legs_sum_us": legs, "model_us": model * 1e6,
                    "measured_over_legs": s["hier"][1] / legs, "measured_over_model": s["hier"][1] / (model * 1e6)})
    return {"fitted": {"shm": shm, "net_leaders": net, "net_shards": shard_net}, "rows": out, "meta": meta}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", metavar="BENCH_JSON", help="bench/hier_allreduce.py's JSON to check the model against")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    pred = predict()
    print("prediction (us): hierarchical (path) vs flat, and flat/hier")
    for label, *_ in SYSTEMS:
        print(f"\n{label}; large path from (bytes, per host count): {crossover(label)}")
        print("hosts " + "".join(f"{m:>26}" for m in SIZES))
        for H in HOSTS:
            cells = [p for p in pred if p["system"] == label and p["hosts"] == H]
            print(f"{H:5} " + "".join(f"{p['hier_us']:9.1f}{p['path'][0]} {p['flat_us']:9.1f} "
                                       f"{p['flat_over_hier']:5.2f}" for p in cells))
    result = {"links": LINKS, "systems": SYSTEMS, "prediction": pred,
              "crossover": {label: crossover(label) for label, *_ in SYSTEMS}}
    if args.check:
        c = check(args.check)
        result["check"] = c
        f = c["fitted"]
        print(f"\ncheck against {args.check} (fitted: shm alpha {f['shm'][0] * 1e6:.1f} us "
              f"bw {f['shm'][1] / 1e9:.2f} GB/s; "
              f"leaders' network alpha {f['net_leaders'][0] * 1e6:.1f} us bw {f['net_leaders'][1] / 1e9:.2f} GB/s; "
              f"shards' alpha {f['net_shards'][0] * 1e6:.1f} us bw {f['net_shards'][1] / 1e9:.2f} GB/s)")
        print(f"{'bytes':>10} {'measured':>10} {'sum of legs':>12} {'model':>10} {'meas/legs':>10} {'meas/model':>10}")
        for r in c["rows"]:
            print(f"{r['bytes']:>10} {r['measured_us']:10.1f} {r['legs_sum_us']:12.1f} {r['model_us']:10.1f} "
                  f"{r['measured_over_legs']:10.2f} {r['measured_over_model']:10.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
