"""Host discovery from sysfs (or from a captured copy of it).

`read_host(root)` reads, under root (default "/"):
  sys/devices/system/cpu/online                         the CPUs
  sys/devices/system/cpu/cpuN/topology/physical_package_id, core_id, thread_siblings_list
  sys/devices/system/cpu/cpuN/cache/indexK/{level,type,shared_cpu_list,size,id}   the L3 (level 3)
  sys/devices/system/node/nodeN/{cpulist,distance}      NUMA nodes and the SLIT distance row
  proc/self/status (Cpus_allowed_list)                  captured trees only: the allowed CPUs
A live read (root "/") takes the allowed CPUs from sched_getaffinity instead.
A missing or malformed required file raises TopologyError naming it."""
import os
import re

from .errors import TopologyError
from .graph import Topology

_RANGE = re.compile(r"^\s*(\d+)(?:-(\d+))?\s*$")


def parse_cpu_list(text, where="cpu list"):
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's list format; empty = none)."""
    out = []
    text = text.strip()
    if not text:
        return out
    for part in text.split(","):
        m = _RANGE.match(part)
        if not m:
            raise TopologyError(f"{where}: {text!r} is not a CPU list")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi - lo > 1 << 16:
            raise TopologyError(f"{where}: bad range {part!r}")
        out.extend(range(lo, hi + 1))
    return out


def _read(root, rel, required=True):
    path = os.path.join(root, rel)
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        if required:
            raise TopologyError(f"{path}: missing (is {root!r} a sysfs tree?)") from None
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise TopologyError(f"{path}: unreadable ({e})") from None


def _int(root, rel, required=True):
    text = _read(root, rel, required)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise TopologyError(f"{os.path.join(root, rel)}: {text.strip()!r} is not an integer") from None


def _size_bytes(text):
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text or "")
    if not m:
        return None
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def _l3_of(root, cpu):
    """(id, shared cpus, size) of cpu's level-3 cache, or None."""
    base = f"sys/devices/system/cpu/cpu{cpu}/cache"
    if not os.path.isdir(os.path.join(root, base)):
        return None
    for entry in sorted(os.listdir(os.path.join(root, base))):
        if not entry.startswith("index"):
            continue
        if _int(root, f"{base}/{entry}/level", required=False) != 3:
            continue
        shared = parse_cpu_list(_read(root, f"{base}/{entry}/shared_cpu_list"), f"cpu{cpu} {entry}")
        cid = _int(root, f"{base}/{entry}/id", required=False)
        return cid, shared, _size_bytes(_read(root, f"{base}/{entry}/size", required=False))
    return None


def _numa_nodes(root):
    """{node: (cpus, distance row)}; {} when the tree has no node directory (no NUMA support)."""
    base = os.path.join(root, "sys/devices/system/node")
    if not os.path.isdir(base):
        return {}
    out = {}
    for entry in os.listdir(base):
        m = re.fullmatch(r"node(\d+)", entry)
        if not m:
            continue
        n = int(m.group(1))
        cpus = parse_cpu_list(_read(root, f"sys/devices/system/node/{entry}/cpulist"), f"{entry}/cpulist")
        row_text = _read(root, f"sys/devices/system/node/{entry}/distance", required=False)
        try:
            row = [int(x) for x in row_text.split()] if row_text else []
        except ValueError:
            raise TopologyError(f"{base}/{entry}/distance: {row_text.strip()!r} is not a distance row") from None
        out[n] = (cpus, row)
    return out


def _allowed(root, online, live):
    if live:
        return sorted(os.sched_getaffinity(0))
    status = _read(root, "proc/self/status", required=False)
    if status:
        m = re.search(r"^Cpus_allowed_list:\s*(\S*)", status, re.M)
        if m:
            return parse_cpu_list(m.group(1), "proc/self/status Cpus_allowed_list")
    return list(online)


def read_host(root="/", topo=None):
    """Adds the host (packages, NUMA nodes, L3 domains, cores) to topo (a new Topology if None)."""
    live = os.path.abspath(root) == "/"
    topo = topo or Topology(source="sysfs" if live else f"sysfs tree {root}")
    online = parse_cpu_list(_read(root, "sys/devices/system/cpu/online"), "cpu/online")
    if not online:
        raise TopologyError(f"{root}: no online CPUs")
    nodes = _numa_nodes(root)
    numa_of = {cpu: n for n, (cpus, _) in nodes.items() for cpu in cpus}

    cores = {}  # (package, core_id) -> attrs
    l3s = {}    # l3 id -> (cpus, size)
    for cpu in online:
        t = f"sys/devices/system/cpu/cpu{cpu}/topology"
        pkg = _int(root, f"{t}/physical_package_id")
        core_id = _int(root, f"{t}/core_id")
        sib_text = _read(root, f"{t}/thread_siblings_list", required=False) or _read(root, f"{t}/core_cpus_list")
        siblings = parse_cpu_list(sib_text, f"cpu{cpu} thread siblings")
        if cpu not in siblings:
            raise TopologyError(f"{root}/{t}/thread_siblings_list: {siblings} does not contain cpu{cpu}")
        l3 = _l3_of(root, cpu)
        l3_id = None
        if l3 is not None:
            cid, shared, size = l3
            l3_id = cid if cid is not None else min(shared)
            if l3_id in l3s and set(l3s[l3_id][0]) != set(shared):
                raise TopologyError(f"{root}: cpu{cpu}'s L3 {l3_id} lists CPUs {shared}, another CPU {l3s[l3_id][0]}")
            l3s[l3_id] = (shared, size)
        key = (pkg, core_id, min(siblings))
        c = cores.setdefault(key, {"package": pkg, "core_id": core_id, "cpus": sorted(siblings),
                                   "l3": l3_id, "numa": numa_of.get(cpu)})
        if c["l3"] != l3_id or c["numa"] != numa_of.get(cpu):
            raise TopologyError(f"{root}: SMT siblings {siblings} disagree on their L3 or NUMA node")

    m = topo.nodes["machine"]
    m.attrs.update(online_cpus=online, allowed_cpus=_allowed(root, online, live))
    for pkg in sorted({c["package"] for c in cores.values()}):
        topo.add(f"package:{pkg}", "package", "machine")
    for n, (cpus, _row) in sorted(nodes.items()):
        pkgs = sorted({c["package"] for c in cores.values() if c["numa"] == n})
        parent = f"package:{pkgs[0]}" if len(pkgs) == 1 else "machine"  # memory-only nodes hang off the machine
        topo.add(f"numa:{n}", "numa", parent, cpus=sorted(cpus))
    for l3_id, (cpus, size) in sorted(l3s.items()):
        pkgs = sorted({c["package"] for c in cores.values() if c["l3"] == l3_id})
        topo.add(f"l3:{l3_id}", "l3", f"package:{pkgs[0]}" if len(pkgs) == 1 else "machine",
                 cpus=sorted(cpus), size_bytes=size)
    for (pkg, core_id, first), c in sorted(cores.items(), key=lambda kv: kv[0][2]):
        parent = f"l3:{c['l3']}" if c["l3"] is not None else (f"numa:{c['numa']}" if c["numa"] is not None
                                                              else f"package:{pkg}")
        topo.add(f"core:{first}", "core", parent, **c)
    ids = sorted(nodes)
    for a in ids:
        row = nodes[a][1]
        if row and len(row) != len(ids):
            raise TopologyError(f"{root}: node{a}/distance has {len(row)} entries for {len(ids)} nodes")
        for j, b in enumerate(ids):
            if row:
                topo.link(f"numa:{a}", f"numa:{b}", "numa", row[j])
    return topo
