"""MPICH's shared-memory segments (/dev/shm/mpich_shm_*), for ranks that will not reach
MPI_Finalize.

MPICH keeps the names of its segments (one per node at MPI_Init: one per clique when
MPIR_CVAR_NUM_CLIQUES simulates hosts; more for some communicators) until MPI_Finalize
unlinks them.  A rank that ends any other way leaves them behind: the failure tests end
ranks with os._exit (MPI_Finalize would wait for the dead rank), and under mpiexec's
default the launcher SIGKILLs the rest of the job when one rank dies.  So those ranks
drop the names once every rank has attached (after a collective over the world), as
KCCL does with its own segments: from then on, however a rank ends, nothing is left.
Unlinking a name leaves the mapping in place; MPI_Finalize, if it still runs, finds the
name gone and carries on."""
import os

PREFIX = "/dev/shm/mpich_shm_"


def mapped_mpi_segments():
    """The names of the MPICH segments this process maps, also those a peer on the same
    node has unlinked already (the map then says "(deleted)")."""
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if path.endswith(" (deleted)"):
                path = path[:-len(" (deleted)")]
            if path.startswith(PREFIX):
                names.add(path)
    return sorted(names)


def forget_mpi_segments():
    """Unlinks the MPICH segments this process maps and returns their names (whichever rank
    of a node gets there first unlinks them); call it on every rank once all of them have
    attached (after a collective over MPI_COMM_WORLD)."""
    names = mapped_mpi_segments()
    for path in names:
        try:
            os.unlink(path)
        except FileNotFoundError:  # a peer on the same node was first
            pass
    return names
