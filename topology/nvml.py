"""NVIDIA GPUs: from NVML (nvidia-ml-py, optional) or from a captured NVML JSON.

The JSON is what `capture()` writes, so a fixture and a live read go through one
builder (`add_gpus`):
  {"format": "kccl-nvml/1", "driver": "...",
   "gpus": [{"index": 0, "name": "NVIDIA H200", "pci_bus_id": "00000000:18:00.0",
             "numa_node": 0, "sm_count": 132, "l2_bytes": 52428800, "memory_bytes": ...}, ...],
   "links": [[null, "nvlink:18", ...], ...]}   # links[i][j]: "nvlink:<n>", "pcie" or null
sm_count / l2_bytes may be null (NVML does not report them for every GPU): the
chip model fills them in."""

from . import chips
from .errors import TopologyError, load_json


def capture():
    """The live machine's GPUs as the JSON document above; needs nvidia-ml-py."""
    try:
        import pynvml as nv
    except ImportError:
        raise TopologyError("nvidia-ml-py is not installed (pip install nvidia-ml-py); "
                            "or pass a captured NVML JSON") from None
    nv.nvmlInit()
    try:
        n = nv.nvmlDeviceGetCount()
        hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        gpus = []
        for i, h in enumerate(hs):
            name = nv.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            pci = nv.nvmlDeviceGetPciInfo(h).busId
            pci = pci.decode() if isinstance(pci, bytes) else pci
            g = {"index": i, "name": name, "pci_bus_id": pci, "numa_node": None, "sm_count": None,
                 "l2_bytes": None, "memory_bytes": int(nv.nvmlDeviceGetMemoryInfo(h).total)}
            try:
                g["numa_node"] = int(nv.nvmlDeviceGetNumaNodeId(h))
            except (AttributeError, nv.NVMLError):
                pass
            try:
                g["sm_count"] = int(nv.nvmlDeviceGetAttributes(h).multiprocessorCount)
            except (AttributeError, nv.NVMLError):
                pass
            gpus.append(g)
        links = [[None] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                try:
                    st = nv.nvmlDeviceGetP2PStatus(hs[i], hs[j], nv.NVML_P2P_CAPS_INDEX_NVLINK)
                    if st == nv.NVML_P2P_STATUS_OK:
                        links[i][j] = f"nvlink:{_nvlink_count(nv, hs[i])}"
                        continue
                    st = nv.nvmlDeviceGetP2PStatus(hs[i], hs[j], nv.NVML_P2P_CAPS_INDEX_READ)
                    links[i][j] = "pcie" if st == nv.NVML_P2P_STATUS_OK else None
                except nv.NVMLError:
                    links[i][j] = None
        drv = nv.nvmlSystemGetDriverVersion()
        return {"format": "kccl-nvml/1", "driver": drv.decode() if isinstance(drv, bytes) else drv,
                "gpus": gpus, "links": links}
    finally:
        nv.nvmlShutdown()


def _nvlink_count(nv, h):
    n = 0
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            n += nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED
        except nv.NVMLError:
            break
    return n


def load(path):
    return load_json(path, str(path))


def add_gpus(topo, doc, where="NVML JSON"):
    """Adds the document's GPUs (and, from the chip model, their L2 partitions) to topo."""
    if not isinstance(doc, dict) or doc.get("format") != "kccl-nvml/1":
        raise TopologyError(f"{where}: not a kccl-nvml/1 document")
    gpus, links = doc.get("gpus"), doc.get("links")
    if not isinstance(gpus, list) or not isinstance(links, list) or len(links) != len(gpus):
        raise TopologyError(f"{where}: needs a 'gpus' list and an N x N 'links' matrix")
    base = len(topo.of_kind("gpu"))
    for k, g in enumerate(gpus):
        try:
            name, index = str(g["name"]), int(g["index"])
            numa = g.get("numa_node")
            numa = None if numa is None or int(numa) < 0 else int(numa)
        except (KeyError, TypeError, ValueError) as e:
            raise TopologyError(f"{where}: gpu entry {k} malformed ({e})") from None
        if index != k:
            raise TopologyError(f"{where}: gpu entry {k} has index {index}")
        model = chips.lookup(name)
        sms = g.get("sm_count") or (model.compute_units if model else None)
        l2 = g.get("l2_bytes") or (model.l2_bytes_per_die if model else None)
        gid = f"gpu:{base + k}"
        parent = f"numa:{numa}" if numa is not None and f"numa:{numa}" in topo.nodes else "machine"
        topo.add(gid, "gpu", parent, vendor="NVIDIA", name=name, pci_bus_id=g.get("pci_bus_id"),
                 numa=numa, sm_count=sms, l2_bytes=l2, memory_bytes=g.get("memory_bytes"),
                 model=model.name if model else None)
        if model and model.l2_partitions > 1:
            for p in range(model.l2_partitions):
                topo.add(f"{gid}/l2p:{p}", "l2_partition", gid, bytes=l2 // model.l2_partitions if l2 else None,
                         sms=None)  # which SMs are near: measured (bench/gpu/l2_poll.cu), not known here
    for i, row in enumerate(links):
        if not isinstance(row, list) or len(row) != len(gpus):
            raise TopologyError(f"{where}: links row {i} is not {len(gpus)} long")
        for j, v in enumerate(row):
            if v is None or i == j:
                continue
            kind, _, count = str(v).partition(":")
            if kind not in ("nvlink", "pcie") or (count and not count.isdigit()):
                raise TopologyError(f"{where}: links[{i}][{j}] = {v!r}: expected 'nvlink:<n>', 'pcie' or null")
            # distance: 1 hop through NVSwitch / direct NVLink, 2 over PCIe
            topo.link(f"gpu:{base + i}", f"gpu:{base + j}", kind, 1.0 if kind == "nvlink" else 2.0,
                      links=int(count) if count else None)
    return topo
