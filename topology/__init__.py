"""topology/: hardware discovery and placement plans for KCCL.

    topo = topology.discover()                 # this machine (sysfs, KFD, NVML when installed)
    topo = topology.discover("fixtures-tree")  # a captured sysfs tree (+ nvml_json=...)
    p = topology.plan(16, topo)                # domains, their ranks, where each replica lives
    topology.cost.table(topo, [8, 16, 32])     # cross-domain line transfers: replicated vs one copy

    python -m topology [--root DIR] [--nvml FILE] [--file TOPO.json] [--plan N] [--json]

Consulted at communicator init (kccl.Communicator), never on the hot path."""
from . import chips, cost
from .discover import discover, dump, load
from .errors import TopologyError
from .graph import CpuDomain, Link, Node, Topology
from .plan import Plan, plan

__all__ = ["discover", "dump", "load", "plan", "Plan", "Topology", "Node", "Link", "CpuDomain",
           "TopologyError", "chips", "cost"]
