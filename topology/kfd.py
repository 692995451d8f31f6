"""AMD GPUs from the KFD sysfs topology (or a captured copy of it).

Under root: sys/class/kfd/kfd/topology/nodes/<n>/properties holds "key value"
lines (the kernel's kfd_topology.c prints them); GPU nodes have simd_count > 0
and cpu_cores_count 0.  Used here: simd_count, simd_per_cu, num_xcc, device_id,
location_id (PCI bus<<8 | device<<3 | function), domain, gfx_target_version.
nodes/<n>/io_links/<k>/properties: type (2 = PCIe, 11 = XGMI), node_from, node_to, weight.
A GPU's NUMA node is the index of the CPU node its PCIe link reaches (KFD lists
CPU nodes in proximity-domain order, which is Linux's NUMA numbering).
amd-smi is not needed: everything used is in this tree."""
import os
import re

from . import chips
from .errors import TopologyError

KFD = "sys/class/kfd/kfd/topology/nodes"
IOLINK_PCIE, IOLINK_XGMI = 2, 11


def _props(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise TopologyError(f"{path}: {e}") from None
    out = {}
    for ln, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not re.fullmatch(r"-?\d+", parts[1]):
            raise TopologyError(f"{path}:{ln}: expected 'name integer', got {line!r}")
        out[parts[0]] = int(parts[1])
    return out


def present(root):
    return os.path.isdir(os.path.join(root, KFD))


def read_kfd(root, topo):
    """Adds the tree's AMD GPUs (with IOD and XCD nodes from the chip model) to topo."""
    base = os.path.join(root, KFD)
    if not os.path.isdir(base):
        return topo
    nodes = {}
    for entry in os.listdir(base):
        if not entry.isdigit():
            continue
        n = int(entry)
        props = _props(os.path.join(base, entry, "properties"))
        links = []
        ldir = os.path.join(base, entry, "io_links")
        if os.path.isdir(ldir):
            for le in sorted(os.listdir(ldir), key=lambda s: int(s) if s.isdigit() else -1):
                if le.isdigit():
                    links.append(_props(os.path.join(ldir, le, "properties")))
        nodes[n] = (props, links)
    cpu_nodes = sorted(n for n, (p, _) in nodes.items() if p.get("cpu_cores_count", 0) > 0)
    gpu_nodes = sorted(n for n, (p, _) in nodes.items() if p.get("simd_count", 0) > 0
                       and p.get("cpu_cores_count", 0) == 0)
    first = len(topo.of_kind("gpu"))
    gid_of = {}
    for k, n in enumerate(gpu_nodes):
        p, links = nodes[n]
        for key in ("simd_count", "simd_per_cu", "location_id"):
            if key not in p:
                raise TopologyError(f"{base}/{n}/properties: no {key}")
        if p["simd_per_cu"] <= 0:
            raise TopologyError(f"{base}/{n}/properties: simd_per_cu = {p['simd_per_cu']}")
        cus = p["simd_count"] // p["simd_per_cu"]
        nxcc = p.get("num_xcc", 1)
        if nxcc < 1 or cus % nxcc:
            raise TopologyError(f"{base}/{n}/properties: {cus} CUs do not split over num_xcc={nxcc}")
        loc = p["location_id"]
        pci = f"{p.get('domain', 0):04x}:{loc >> 8 & 0xff:02x}:{loc >> 3 & 0x1f:02x}.{loc & 7}"
        numa = None
        for l in links:
            if l.get("type") == IOLINK_PCIE and l.get("node_to") in cpu_nodes:
                numa = cpu_nodes.index(l["node_to"])
        model = chips.AMD_DEVICE_IDS.get(p.get("device_id"))
        if model and (nxcc, cus) != (model.dies, model.compute_units):
            model = None  # a partition mode (CPX) or a cut-down part: the model does not describe it
        gid = f"gpu:{first + k}"
        gid_of[n] = gid
        parent = f"numa:{numa}" if numa is not None and f"numa:{numa}" in topo.nodes else "machine"
        topo.add(gid, "gpu", parent, vendor="AMD", name=model.name if model else f"gfx{p.get('gfx_target_version')}",
                 pci_bus_id=pci, numa=numa, cu_count=cus, num_xcc=nxcc, kfd_node=n,
                 model=model.name if model else None,
                 l2_bytes=model.l2_bytes_per_die * nxcc if model else None,
                 memory_side_cache_bytes=model.memory_side_cache_bytes if model else None)
        if model:
            for i, group in enumerate(model.die_groups):
                iod = f"{gid}/iod:{i}"
                topo.add(iod, "gpu_iod", gid, hbm_stacks=model.hbm_stacks_per_group)
                for x in group:
                    topo.add(f"{gid}/xcd:{x}", "gpu_die", iod, cus=model.units_per_die,
                             l2_bytes=model.l2_bytes_per_die, l2_private=True)
        else:
            for x in range(nxcc):
                topo.add(f"{gid}/xcd:{x}", "gpu_die", gid, cus=cus // nxcc)
    for n in gpu_nodes:
        for l in nodes[n][1]:
            to = l.get("node_to")
            if l.get("type") == IOLINK_XGMI and to in gid_of:
                topo.link(gid_of[n], gid_of[to], "xgmi", float(l.get("weight", 0)))
    return topo
