"""Host identity: which ranks can form one KCCL communicator.

A KCCL communicator maps every peer's POSIX shared-memory segment and watches
every peer's pid, so its ranks must see the same /dev/shm and the same pids: the
same kernel (hostname and boot id; a hostname alone repeats across containers and
clones), the same IPC and pid namespaces and the same /dev/shm file system (two
containers on one kernel each have their own unless started to share them).
Ranks with equal keys are one "host".  The key errs on the side of "another host"
(containers that share /dev/shm but not their hostname become two hosts joined by
MPI: slower, still correct); the C core refuses only what cannot work (a unique id
made where the boot id, /dev/shm or pid namespace differ, uniqueid.c).  For GPU
communicators the same key is necessary but not sufficient (the GPUs must also
reach each other by peer access); that check belongs to the GPU transport's init
and is not made here.

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


def _namespace(kind):
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def _shm_identity():
    try:
        st = os.stat("/dev/shm")
        return f"{st.st_dev}:{st.st_ino}"
    except OSError:
        return ""


def machine_key():
    """hostname|boot id|IPC namespace|pid namespace|/dev/shm device:inode of this process
    (on Linux; elsewhere the hostname and what of the rest can be read)."""
    return "|".join((socket.gethostname(), _first_line("/proc/sys/kernel/random/boot_id"), _namespace("ipc"),
                     _namespace("pid"), _shm_identity()))


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
