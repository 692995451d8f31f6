"""One entry point over every source: `discover()` returns the Topology of the
live machine or of captured trees, and `load()` / `dump()` read and write the
JSON topology file (`python -m topology --json`, KCCL_TOPO_FILE).

A topology file may carry "rank_domains": [d0, d1, ...], the domain of each
rank by rank number.  That pins ranks to domains regardless of where they run;
it exists so that tests (and people with an unusual launcher) can place ranks
explicitly."""
import json
import os

from . import kfd, nvml, sysfs
from .errors import TopologyError, load_json
from .graph import Topology


def discover(root="/", nvml_json=None, live_gpus=None):
    """The machine under root (a sysfs tree; "/" is this machine), its AMD GPUs
    from the KFD tree under the same root, and NVIDIA GPUs from nvml_json (a
    captured file) or, for the live machine, from NVML when nvidia-ml-py is
    installed (live_gpus=None: try it quietly; False: skip; True: required)."""
    topo = sysfs.read_host(root)
    kfd.read_kfd(root, topo)
    if nvml_json is not None:
        nvml.add_gpus(topo, nvml.load(nvml_json), where=str(nvml_json))
    elif live_gpus or (live_gpus is None and os.path.abspath(root) == "/"):
        try:
            doc = nvml.capture()
        except TopologyError:
            if live_gpus:
                raise
        except Exception as e:  # noqa: BLE001 - NVML present but no driver / no GPU: no GPUs
            if live_gpus:
                raise TopologyError(f"NVML: {type(e).__name__}: {e}") from None
        else:
            nvml.add_gpus(topo, doc, where="NVML")
    return topo


def dump(topo, path=None, rank_domains=None):
    d = topo.to_dict()
    if rank_domains is not None:
        d["rank_domains"] = list(rank_domains)
    text = json.dumps(d, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return text


def load(path):
    """(Topology, rank_domains or None) from a topology file."""
    doc = load_json(path, f"topology file {path}")
    if not isinstance(doc, dict):
        raise TopologyError(f"topology file {path}: expected a JSON object")
    topo = Topology.from_dict(doc, where=f"topology file {path}")
    rd = doc.get("rank_domains")
    if rd is not None:
        n = len(topo.cpu_domains())
        if not isinstance(rd, list) or not all(isinstance(x, int) and not isinstance(x, bool) and -1 <= x < n
                                               for x in rd):
            raise TopologyError(f"topology file {path}: rank_domains must list domain numbers in -1..{n - 1}")
    return topo, rd
