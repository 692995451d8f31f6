"""Chip models: what sysfs and NVML cannot show about a GPU's inside.

Each model says how the compute dies and the last-level caches are arranged, so
plan() can name a domain for a GPU rank's flag replicas.  Sources are the
vendors' documents cited in topology/fixtures/README.md (one line per fact)."""
from dataclasses import dataclass
from typing import Optional, Tuple

from .errors import TopologyError

MB = 1 << 20


@dataclass(frozen=True)
class ChipModel:
    name: str
    vendor: str
    compute_units: int          # SMs (NVIDIA) or CUs (AMD)
    dies: int                   # compute dies (MI300X XCDs); 1 for a monolithic die
    units_per_die: int
    die_groups: Tuple[Tuple[int, ...], ...]  # dies sharing an I/O die (MI300X IODs); () if none
    l2_bytes_per_die: int
    l2_private_per_die: bool    # each die's L2 caches only for that die (MI300X)
    l2_partitions: int          # L2 split in partitions with a near and a far half (H100/H200: 2)
    memory_side_cache_bytes: int  # MI300X Infinity Cache (MALL), 0 if none
    hbm_stacks_per_group: int
    note: str

    @property
    def replica_domains(self) -> int:
        """How many flag copies one GPU of this chip wants: one per IOD (MI300X: a flag
        polled from an XCD is served by the Infinity Cache slice of the HBM stack it
        lives in), one per L2 partition (H100/H200), else 1."""
        if self.die_groups:
            return len(self.die_groups)
        return max(1, self.l2_partitions)


MI300X = ChipModel(
    name="MI300X", vendor="AMD", compute_units=304, dies=8, units_per_die=38,
    die_groups=((0, 1), (2, 3), (4, 5), (6, 7)), l2_bytes_per_die=4 * MB, l2_private_per_die=True,
    l2_partitions=1, memory_side_cache_bytes=256 * MB, hbm_stacks_per_group=2,
    note="8 XCDs x 38 CUs on 4 IODs; XCD-private 4 MB L2; 256 MB Infinity Cache on the memory side")

# H100 SXM5 and H200 are the same GH100 configuration (132 SMs, 50 MB L2); H200 changes the memory.
H100 = ChipModel(
    name="H100", vendor="NVIDIA", compute_units=132, dies=1, units_per_die=132, die_groups=(),
    l2_bytes_per_die=50 * MB, l2_private_per_die=False, l2_partitions=2, memory_side_cache_bytes=0,
    hbm_stacks_per_group=5,
    note="132 SMs; 50 MB L2 in two partitions (an SM reaches the far one through the crossbar); "
         "which SMs are near which partition is measured by bench/gpu/l2_poll.cu")
H200 = ChipModel(**{**H100.__dict__, "name": "H200", "hbm_stacks_per_group": 6,
                    "note": H100.note.replace("132 SMs", "132 SMs (GH100 as H100 SXM5), 141 GB HBM3e")})

MODELS = {m.name: m for m in (MI300X, H100, H200)}
# PCI device ids (KFD's device_id is decimal): 0x74a1 = MI300X
AMD_DEVICE_IDS = {0x74a1: MI300X}


def lookup(name: str) -> Optional[ChipModel]:
    """The model for an NVML or marketing name ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "MI300X")."""
    up = name.upper()
    for key in ("H200", "H100", "MI300X"):
        if key in up:
            return MODELS[key]
    return None


def iod_of_xcd(model: ChipModel, xcd: int) -> int:
    for i, group in enumerate(model.die_groups):
        if xcd in group:
            return i
    raise TopologyError(f"{model.name} has no XCD {xcd}")
