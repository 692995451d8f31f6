"""Host identity: which ranks can form one KCCL communicator.

A KCCL communicator maps every peer's POSIX shared-memory segment, so its ranks
must see the same /dev/shm: the same kernel (hostname and boot id; a hostname
alone repeats across containers and clones) and the same IPC namespace (two
containers on one kernel with private IPC namespaces each have their own
/dev/shm).  Ranks with equal keys are one "host".  For GPU communicators the
same key is necessary but not sufficient (the GPUs must also reach each other by
peer access); that check belongs to the GPU transport's init and is not made here.

KCCL_HOST_ID (or config={"host_id": ...}) replaces the key, so that one machine can
pretend to be several hosts (tests, benchmarks of the inter-host path)."""
import os
import socket


def _first_line(path):
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:  # no procfs (not Linux): the hostname alone has to do
        return ""


def _ipc_namespace():
    try:
        return os.readlink("/proc/self/ns/ipc")
    except OSError:
        return ""


def machine_key():
    """hostname|boot id|IPC namespace of this process: equal exactly for processes
    that share /dev/shm (on Linux; elsewhere the hostname)."""
    return "|".join((socket.gethostname(), _first_line("/proc/sys/kernel/random/boot_id"), _ipc_namespace()))


def host_key(settings):
    """This rank's host key from resolved settings (kccl.config.resolve): KCCL_HOST_ID when
    given, else machine_key()."""
    given = settings["KCCL_HOST_ID"][0]
    return given if given else machine_key()


class HostLayout:
    """Where every rank of a world sits, from each rank's host key (world rank order).

    Hosts are numbered in the order of their lowest world rank, so host 0 holds world
    rank 0 and host h's leader (its lowest rank) has rank h among the leaders.
    local_rank[r] is r's index among its host's ranks (in world rank order)."""

    def __init__(self, keys):
        index = {}
        self.host_of = [index.setdefault(k, len(index)) for k in keys]
        self.keys = list(index)
        self.members = [[] for _ in index]  # world ranks of each host, ascending
        for r, h in enumerate(self.host_of):
            self.members[h].append(r)
        self.local_rank = [0] * len(keys)
        for ranks in self.members:
            for i, r in enumerate(ranks):
                self.local_rank[r] = i
        self.sizes = [len(m) for m in self.members]

    @property
    def nhosts(self):
        return len(self.members)

    def __repr__(self):
        return f"HostLayout({self.members})"
