"""The typed topology graph every discovery source returns.

Nodes are hardware objects (machine, package, numa, l3, core, gpu, gpu_iod,
gpu_die, l2_partition); links say how two nodes relate: `contains` (a tree edge,
distance 0), `numa` (the SLIT distance between two NUMA nodes), `nvlink`,
`xgmi`, `pcie` (GPU to GPU or GPU to its host NUMA node).  Node ids are
"<kind>:<index>" (GPU parts: "gpu:3/iod:1"), so a graph serialises to JSON and
back without losing anything (`Topology.to_dict` / `from_dict`)."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .errors import TopologyError

NODE_KINDS = ("machine", "package", "numa", "l3", "core", "gpu", "gpu_iod", "gpu_die", "l2_partition")
LINK_KINDS = ("contains", "numa", "nvlink", "xgmi", "pcie")


@dataclass(frozen=True)
class Node:
    id: str
    kind: str
    attrs: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    kind: str
    distance: float = 0.0
    attrs: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class CpuDomain:
    """A set of cores that share one L3 and one NUMA node: one replica's readers.
    key names it ("l3:3/numa:1"); numa is the node its replica pages are bound to."""
    index: int
    key: str
    numa: Optional[int]
    cpus: frozenset


class Topology:
    def __init__(self, source="unknown"):
        self.source = source
        self.nodes: Dict[str, Node] = {}
        self.links: List[Link] = []
        self._children: Dict[str, List[str]] = {}
        self.add("machine", "machine")

    # -- building -----------------------------------------------------------------------------
    def add(self, node_id, kind, parent=None, **attrs):
        if kind not in NODE_KINDS:
            raise TopologyError(f"unknown node kind {kind!r}")
        if node_id in self.nodes:
            raise TopologyError(f"duplicate node {node_id!r}")
        self.nodes[node_id] = Node(node_id, kind, dict(attrs))
        self._children[node_id] = []
        if parent is not None:
            self.link(parent, node_id, "contains")
        return self.nodes[node_id]

    def link(self, a, b, kind, distance=0.0, **attrs):
        if kind not in LINK_KINDS:
            raise TopologyError(f"unknown link kind {kind!r}")
        for n in (a, b):
            if n not in self.nodes:
                raise TopologyError(f"link {a} -> {b}: no node {n!r}")
        self.links.append(Link(a, b, kind, float(distance), dict(attrs)))
        if kind == "contains":
            self._children[a].append(b)

    # -- queries ------------------------------------------------------------------------------
    def of_kind(self, kind) -> List[Node]:
        return [n for n in self.nodes.values() if n.kind == kind]

    def children(self, node_id, kind=None) -> List[Node]:
        out = [self.nodes[c] for c in self._children.get(node_id, ())]
        return [n for n in out if kind is None or n.kind == kind]

    def links_of(self, kind) -> List[Link]:
        return [l for l in self.links if l.kind == kind]

    def numa_distance(self, a: int, b: int) -> Optional[float]:
        for l in self.links_of("numa"):
            if (l.a, l.b) == (f"numa:{a}", f"numa:{b}"):
                return l.distance
        return None

    @property
    def allowed_cpus(self) -> frozenset:
        return frozenset(self.nodes["machine"].attrs.get("allowed_cpus", ()))

    def cpu_domains(self) -> List[CpuDomain]:
        """Cores grouped by (L3, NUMA node), in order of their lowest CPU.  The finer of
        the two wins: on an AMD EPYC in NPS4 a NUMA node holds three CCDs, so a domain
        is one CCD; on an Intel Xeon with sub-NUMA clustering one L3 spans several
        NUMA nodes, and a line's home LLC slices sit in its NUMA node's part of the
        die, so a domain is one SNC node.  A core whose L3 is unknown counts as its
        own NUMA node's."""
        groups: Dict[Tuple, set] = {}
        for core in self.of_kind("core"):
            k = (core.attrs.get("l3"), core.attrs.get("numa"))
            groups.setdefault(k, set()).update(core.attrs["cpus"])
        ordered = sorted(groups.items(), key=lambda kv: min(kv[1]))
        out = []
        for i, ((l3, numa), cpus) in enumerate(ordered):
            key = "/".join(p for p in (None if l3 is None else f"l3:{l3}",
                                       None if numa is None else f"numa:{numa}") if p) or "machine"
            out.append(CpuDomain(i, key, numa, frozenset(cpus)))
        return out

    def cpu_to_domain(self) -> Dict[int, int]:
        return {cpu: d.index for d in self.cpu_domains() for cpu in d.cpus}

    # -- (de)serialisation --------------------------------------------------------------------
    def to_dict(self):
        return {"format": "kccl-topology/1", "source": self.source,
                "nodes": [{"id": n.id, "kind": n.kind, "attrs": n.attrs} for n in self.nodes.values()],
                "links": [{"a": l.a, "b": l.b, "kind": l.kind, "distance": l.distance, "attrs": l.attrs}
                          for l in self.links]}

    @classmethod
    def from_dict(cls, d, where="topology"):
        try:
            if d.get("format") != "kccl-topology/1":
                raise TopologyError(f"{where}: not a kccl-topology/1 document (format={d.get('format')!r})")
            t = cls(d.get("source", where))
            for n in d["nodes"]:
                if n["id"] == "machine":
                    t.nodes["machine"].attrs.update(n.get("attrs", {}))
                    continue
                t.add(n["id"], n["kind"], **n.get("attrs", {}))
            for l in d["links"]:
                t.link(l["a"], l["b"], l["kind"], l.get("distance", 0.0), **l.get("attrs", {}))
            for c in t.of_kind("core"):
                cpus = c.attrs.get("cpus")
                if not isinstance(cpus, list) or not cpus or not all(isinstance(x, int) and x >= 0 for x in cpus):
                    raise TopologyError(f"{where}: core {c.id} needs a non-empty list of CPU numbers")
            return t
        except TopologyError:
            raise
        except (KeyError, TypeError, AttributeError) as e:
            raise TopologyError(f"{where}: malformed topology document ({type(e).__name__}: {e})") from None
