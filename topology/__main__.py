"""python -m topology: this machine (or a captured tree / topology file) as a tree.

    python -m topology                          # this machine
    python -m topology --root DIR [--nvml F]    # a captured sysfs/KFD tree (+ NVML JSON)
    python -m topology --file TOPO.json         # a topology file (KCCL_TOPO_FILE format)
    python -m topology --plan N                 # + the placement plan for N ranks (one per core;
                                                #   beyond the CPUs, round-robin: oversubscribed)
    python -m topology --plan gpu:0,gpu:1       # + the plan for GPU ranks
    python -m topology --json [OUT]             # the graph (and plan) as JSON, to OUT or stdout
    python -m topology --cost 8,16,32           # + the cost-model table for those rank counts"""
import argparse
import json
import sys

from . import cost
from .discover import discover, dump, load
from .errors import TopologyError
from .plan import list_text, plan


def _mib(b):
    return f"{b / (1 << 20):g} MiB" if b else "? MiB"


def tree(topo):
    m = topo.nodes["machine"].attrs
    online = m.get("online_cpus", [])
    lines = [f"machine ({topo.source}): {len(online)} CPUs online ({list_text(online)}), "
             f"allowed {list_text(m.get('allowed_cpus', []))}, {len(topo.cpu_domains())} cache domain(s)"]
    cores = topo.of_kind("core")
    for pkg in sorted(topo.of_kind("package"), key=lambda n: int(n.id.split(":")[1])):
        p = int(pkg.id.split(":")[1])
        pc = [c for c in cores if c.attrs["package"] == p]
        lines.append(f"  package {p}: {len(pc)} cores, {sum(len(c.attrs['cpus']) for c in pc)} CPUs")
        numas = sorted({c.attrs["numa"] for c in pc}, key=lambda x: -1 if x is None else x)
        for n in numas:
            nc = [c for c in pc if c.attrs["numa"] == n]
            dist = ""
            if n is not None:
                row = [topo.numa_distance(n, o) for o in sorted(int(x.id.split(':')[1]) for x in topo.of_kind("numa"))]
                dist = f", distances {' '.join(str(int(d)) for d in row if d is not None)}"
            lines.append(f"    numa {n if n is not None else '?'}: {len(nc)} cores{dist}")
            for l3 in sorted({c.attrs["l3"] for c in nc}, key=lambda x: -1 if x is None else x):
                lc = [c for c in nc if c.attrs["l3"] == l3]
                node = topo.nodes.get(f"l3:{l3}")
                spans = ""
                if node is not None:
                    others = sorted({c.attrs["numa"] for c in cores if c.attrs["l3"] == l3} - {n},
                                    key=lambda x: -1 if x is None else x)
                    spans = f", shared with numa {list_text(others)}" if others else ""
                size = _mib(node.attrs.get("size_bytes")) if node is not None else "no L3"
                cpus = sorted(x for c in lc for x in c.attrs["cpus"])
                smt = max(len(c.attrs["cpus"]) for c in lc)
                lines.append(f"      l3 {l3 if l3 is not None else '-'} ({size}{spans}): {len(lc)} cores x {smt} "
                             f"threads, cpus {list_text(cpus)}")
    for g in sorted(topo.of_kind("gpu"), key=lambda n: int(n.id.split(":")[1])):
        a = g.attrs
        units = f"{a['sm_count']} SMs" if a.get("sm_count") else f"{a.get('cu_count')} CUs"
        lines.append(f"  {g.id} {a.get('name')} (pci {a.get('pci_bus_id')}, numa {a.get('numa')}, {units}, "
                     f"L2 {_mib(a.get('l2_bytes'))}{', model ' + a['model'] if a.get('model') else ''})")
        for child in topo.children(g.id):
            if child.kind == "gpu_iod":
                xcds = [x.id.split("/")[-1] for x in topo.children(child.id)]
                lines.append(f"    {child.id.split('/')[-1]}: {', '.join(xcds)} "
                             f"({topo.children(child.id)[0].attrs.get('cus')} CUs and a private "
                             f"{_mib(topo.children(child.id)[0].attrs.get('l2_bytes'))} L2 each), "
                             f"{child.attrs.get('hbm_stacks')} HBM stacks")
            elif child.kind == "l2_partition":
                lines.append(f"    {child.id.split('/')[-1]}: {_mib(child.attrs.get('bytes'))} of L2 "
                             f"(near SMs: measured by bench/gpu/l2_poll.cu)")
            elif child.kind == "gpu_die":
                lines.append(f"    {child.id.split('/')[-1]}: {child.attrs.get('cus')} CUs")
    kinds = {}
    for l in topo.links:
        if l.kind in ("nvlink", "xgmi", "pcie"):
            kinds.setdefault(l.kind, []).append(l)
    for k, ls in kinds.items():
        n = len({l.a for l in ls} | {l.b for l in ls})
        extra = f", {ls[0].attrs['links']} links each" if ls[0].attrs.get("links") else ""
        lines.append(f"  {k}: {len(ls)} directed GPU pairs among {n} GPUs (distance {ls[0].distance:g}{extra})")
    return "\n".join(lines)


def _parse_plan(text):
    if "gpu" in text:
        return [t.strip() for t in text.split(",") if t.strip()]
    try:
        return int(text)
    except ValueError:
        raise TopologyError(f"--plan {text!r}: expected a rank count or gpu:i,gpu:j,...") from None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m topology", description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/", help="a captured sysfs/KFD tree (default: this machine)")
    ap.add_argument("--nvml", help="a captured NVML JSON (kccl-nvml/1)")
    ap.add_argument("--file", help="a topology file (python -m topology --json output)")
    ap.add_argument("--plan", help="rank count (one per core) or gpu:0,gpu:1,...")
    ap.add_argument("--cost", help="comma-separated rank counts for the cost-model table")
    ap.add_argument("--bytes", type=int, default=8, help="message size for --cost (default 8)")
    ap.add_argument("--json", nargs="?", const="-", help="write JSON (to a file, or - for stdout)")
    a = ap.parse_args(argv)
    try:
        rank_domains = None
        if a.file:
            topo, rank_domains = load(a.file)
        else:
            topo = discover(a.root, nvml_json=a.nvml)
        p = plan(_parse_plan(a.plan), topo, rank_domains if isinstance(_parse_plan(a.plan), int)
                 and rank_domains and len(rank_domains) == _parse_plan(a.plan) else None) if a.plan else None
        rows = None
        if a.cost:
            counts = [int(x) for x in a.cost.split(",") if x.strip()]
            if not counts or min(counts) < 1:
                raise TopologyError(f"--cost {a.cost!r}: expected positive rank counts")
            rows = cost.table(topo, counts, a.bytes)
    except (TopologyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        doc = json.loads(dump(topo, rank_domains=rank_domains))
        if p is not None:
            doc["plan"] = p.to_dict()
        if rows is not None:
            doc["cost"] = rows
        text = json.dumps(doc, indent=1)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text + "\n")
            print(f"wrote {a.json}", file=sys.stderr)
        return 0
    print(tree(topo))
    if p is not None:
        print(p.describe())
    if rows is not None:
        print(cost.format_table(topo.source, rows, a.bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
