"""Topology files of fake machines for the replica tests: this 2-CPU machine
described as if its CPUs sat in different L3 domains."""
import topology
from topology.graph import Topology


def fake_l3s(path, domains_of_cpu=(0, 1), numa_of_domain=None, rank_domains=None, l3_base=0):
    """CPU i in L3 domain domains_of_cpu[i]; domain d on NUMA node numa_of_domain[d] (default 0:
    this machine's only node); rank_domains pins ranks (None: by affinity).  Returns path."""
    ndom = max(domains_of_cpu) + 1
    numa_of_domain = numa_of_domain or [0] * ndom
    t = Topology("fake machine for tests")
    cpus = list(range(len(domains_of_cpu)))
    t.nodes["machine"].attrs.update(online_cpus=cpus, allowed_cpus=cpus)
    t.add("package:0", "package", "machine")
    for n in sorted(set(numa_of_domain)):
        t.add(f"numa:{n}", "numa", "package:0",
              cpus=[c for c in cpus if numa_of_domain[domains_of_cpu[c]] == n])
    for d in range(ndom):
        t.add(f"l3:{l3_base + d}", "l3", "package:0", cpus=[c for c in cpus if domains_of_cpu[c] == d],
              size_bytes=1 << 20)
    for c in cpus:
        d = domains_of_cpu[c]
        t.add(f"core:{c}", "core", f"l3:{l3_base + d}", cpus=[c], package=0, core_id=c, l3=l3_base + d,
              numa=numa_of_domain[d])
    topology.dump(t, str(path), rank_domains)
    return str(path)
