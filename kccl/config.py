"""The one registry of KCCL_* settings.

Every setting KCCL reads is listed here with its type, default and meaning.
The Python package resolves them from the environment (or from overrides
given to `Communicator(..., config={...})`) and hands them to the C core in a
kcclConfig_t; C programs get the same names and defaults from kcclConfigInit.

    python -m kccl.config     # prints every setting, its value and where it came from
"""
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from .errors import KcclInvalidArgument

ALGOS = {"auto": 0, "oneshot": 1, "twoshot": 2}
DEBUG_LEVELS = {"NONE": 0, "WARN": 1, "INFO": 2, "TRACE": 3}
TOPO_MODES = {"off": 0, "on": 1}


def _int_range(lo, hi, sizes=False, multiple=1):
    def parse(text):
        s = str(text).strip()
        mult = 1
        if sizes and s[-1:] in "kKmM" and s[:-1]:
            mult = 1024 if s[-1] in "kK" else 1024 * 1024
            s = s[:-1]
        if not re.fullmatch(r"[+-]?[0-9]+", s):  # what C's strtol takes, nothing more
            raise ValueError(f"expected an integer{' (k/M suffix allowed)' if sizes else ''}")
        v = int(s) * mult
        if not lo <= v <= hi:
            raise ValueError(f"expected a value in [{lo}, {hi}]")
        if v % multiple:
            raise ValueError(f"expected a multiple of {multiple}")
        return v
    return parse


def _choice(table):
    def parse(text):
        s = str(text).strip()
        for name, v in table.items():
            if s.lower() == name.lower() or s == str(v):
                return name
        raise ValueError(f"expected one of {', '.join(table)}")
    return parse


def _path(text):
    s = str(text).strip()
    if not s:
        raise ValueError("expected a file path")
    return s


@dataclass(frozen=True)
class Setting:
    name: str          # environment variable
    field: str         # kcclConfig_t field (or, with native=False, the override key)
    default: object
    parse: Callable
    doc: str
    native: bool = True  # False: Python resolves it (topology placement); C never reads it


SETTINGS: Tuple[Setting, ...] = (
    Setting("KCCL_TIMEOUT_MS", "timeout_ms", 30000, _int_range(0, 86_400_000),
            "Bound on any wait (init and collectives), in ms; 0 waits forever. A dead peer is "
            "reported within about 1 ms whatever this is."),
    Setting("KCCL_ALGO", "algo", "auto", _choice(ALGOS),
            "All-reduce algorithm: auto (by size, see KCCL_ONESHOT_MAX_BYTES), oneshot or twoshot."),
    Setting("KCCL_ONESHOT_MAX_BYTES", "oneshot_max_bytes", 16 * 1024, _int_range(0, 1 << 40, sizes=True),
            "Largest all-reduce (bytes) that auto sends one-shot; larger ones go two-shot."),
    Setting("KCCL_BUFFER_BYTES", "buffer_bytes", 1024 * 1024, _int_range(4096, 1 << 30, sizes=True),
            "Bytes per shared-memory slot, the chunk size of large messages (each rank maps "
            "4 slots per rank). Must be equal on all ranks."),
    Setting("KCCL_SPIN_US", "spin_us", -1, _int_range(-1, 10_000_000),
            "Busy-poll time before yielding the CPU; -1 = auto (100 us with a core per rank, "
            "0 when ranks outnumber cores: a spinning rank would hold the core its peer needs)."),
    Setting("KCCL_YIELD_US", "yield_us", -1, _int_range(-1, 10_000_000),
            "sched_yield phase after spinning, before sleeping on a futex; -1 = auto (2000 us, "
            "or 1000 us when ranks outnumber cores)."),
    Setting("KCCL_GPU_ONESHOT_MAX_BYTES", "gpu_oneshot_max_bytes", 256 * 1024, _int_range(0, 1 << 40, sizes=True),
            "GPU communicators: largest all-reduce (bytes) that auto sends one-shot (LL push; "
            "capped by the kernel's capacity: 8 KB per block times the blocks that fit beside the peers' "
            "with SMs to spare; 144 KB at 8 ranks on one H200); larger ones go two-shot."),
    Setting("KCCL_GPU_BUFFER_BYTES", "gpu_buffer_bytes", 16 * 1024 * 1024, _int_range(65536, 1 << 32, sizes=True),
            "GPU communicators: chunk size of two-shot all-reduce, reduce-scatter, all-gather and "
            "broadcast (each rank allocates 4 such areas on its GPU). Must be equal on all ranks."),
    Setting("KCCL_GPU_PDL", "gpu_pdl", 1, _int_range(0, 1),
            "GPU communicators: 1 launches the one-shot all-reduce with programmatic dependent launch "
            "(Hopper): the next call's kernel starts launching while this one runs (0: plain launches). "
            "A call whose grid and the previous one-shot call's together exceed the one-shot block "
            "budget launches plainly; the chunked kernels (two-shot, all-gather, broadcast) always do."),
    Setting("KCCL_GPU_FLAG_REPLICAS", "gpu_flag_replicas", 0, _int_range(0, 1),
            "GPU communicators, opt-in: 1 keeps each two-shot / gather flag twice, once near each L2 "
            "partition (found by timing loads at init); writers write both, a reader polls the copy "
            "near its SM. Disabled (one copy) when the calibration finds no two partitions. "
            "Measured on the H200: no effect. Must be equal on all ranks."),
    Setting("KCCL_GPU_BLOCKS", "gpu_blocks", 0, _int_range(0, 132),
            "GPU communicators: blocks per rank of the chunked kernels (two-shot all-reduce, "
            "reduce-scatter, all-gather, broadcast); 0 = auto: every rank's blocks resident at once, and "
            "the blocks of all ranks of a GPU but one leaving 4 SMs free, so that a late rank's own kernel "
            "can still start (on one H200, one block of KCCL_GPU_CHUNK_THREADS=768 per usable SM: 16 at 8 ranks, "
            "32 at 4, 64 at 2). More can time out (KcclTimeout after "
            "KCCL_TIMEOUT_MS) when a rank launches a kernel of its own before the collective: 8 ranks x 22 "
            "did, behind a torch kernel, with KCCL_GPU_CARVEOUT=-1 (with 100, 26 and 33 passed). Must be "
            "equal on all ranks."),
    Setting("KCCL_GPU_PULL", "gpu_pull", -1, _int_range(-1, 1),
            "GPU communicators: how the one-shot all-reduce (and the device API) moves lines: 1 pull "
            "(each sender writes its lines once, into its own buffer, and peers read them there), 0 push "
            "(into every peer's buffer); -1 = auto: pull when every rank shares one GPU, push across "
            "GPUs (where a remote poll is a round trip over the link). Must be equal on all ranks."),
    Setting("KCCL_GPU_CARVEOUT", "gpu_carveout", 100, _int_range(-1, 100),
            "GPU communicators: the shared-memory carveout (percent of the L1 / shared split) the "
            "collective kernels ask for; -1 = the driver's choice. With the driver's choice, a rank's own "
            "kernel that uses shared memory could not start on SMs holding its peers' waiting blocks, and "
            "with enough blocks per rank every SM held some (bench/gpu/residency.py --foreign 2); with 100 "
            "it could. Per process (a kernel attribute): the last communicator created sets it."),
    Setting("KCCL_GPU_LL_THREADS", "gpu_ll_threads", 256, _int_range(32, 256, multiple=32),
            "GPU communicators: threads per block of the one-shot all-reduce, a multiple of 32. A call is "
            "split into blocks of one 8-byte line per thread (256: 2 KB per block) until the blocks run out, "
            "then more lines per thread. 128 was not faster at 8 KB on one H200 and slower from 64 KB. Must "
            "be equal on all ranks."),
    Setting("KCCL_GPU_LL_HOPS", "gpu_ll_hops", 0, _int_range(0, 2),
            "GPU communicators: how a one-shot all-reduce block of one line per thread (up to 2 KB with "
            "256 threads; the device API too) reaches every rank: 1 hop (every rank reads every rank's "
            "lines), 2 hops (each rank reduces 1/N of the block's lines, then every rank reads the N "
            "reduced parts: N times fewer lines read per rank, one more wait); 0 = auto: 1. Two hops were "
            "faster in one process but not across 8 MPS processes on one H200 (8 KB in a graph 3.44 us "
            "against 3.37). Must be equal on all ranks."),
    Setting("KCCL_GPU_CHUNK_THREADS", "gpu_chunk_threads", 0, _int_range(0, 768, multiple=32),
            "GPU communicators: threads per block of the chunked kernels (two-shot all-reduce, "
            "reduce-scatter, all-gather, broadcast), a multiple of 32 up to 768; 0 = auto: 768 when ranks "
            "share a GPU (one block per SM; 64 MB on one H200 took 0.57x the time of 256 at 8 ranks), "
            "256 with one rank per GPU (not measured). Must be equal on all ranks."),
    Setting("KCCL_DEBUG", "debug", "NONE", _choice(DEBUG_LEVELS),
            "Log to stderr: NONE, WARN (every error), INFO (init details), TRACE."),
    # Placement: Python's topology/ computes it and hands it to kcclCommInitRankPlacement;
    # C programs that call kcclCommInitRankConfig get one copy of everything.
    Setting("KCCL_TOPO", "topo", "on", _choice(TOPO_MODES),
            "Topology-aware replicas: on (one replica of each flag and small slot per L3/NUMA domain "
            "the ranks span; one domain = one copy) or off (one copy). Python only.", native=False),
    Setting("KCCL_TOPO_FILE", "topo_file", "", _path,
            "A topology JSON (python -m topology --json) used instead of this machine's sysfs; may pin "
            "ranks to domains (rank_domains). Python only.", native=False),
    Setting("KCCL_MAX_OUTSTANDING", "max_outstanding", 1, _int_range(1, 8),
            "How many all_reduce_start operations may be in flight (started, not yet waited). "
            "Each rank maps 4 * this (rounded up to a power of two) slots, 4 at 1. "
            "Must be equal on all ranks."),
)
BY_NAME = {s.name: s for s in SETTINGS}

# Read at build time by setup.py (kccl/_build_cuda.py), not by a communicator.
BUILD_SETTINGS = (
    ("KCCL_CUDA", "auto", "Build time: auto compiles the GPU transport when nvcc is found, 1 requires "
     "it (a missing nvcc fails the install), 0 leaves it out."),
)
KNOWN_NAMES = tuple(s.name for s in SETTINGS) + tuple(b[0] for b in BUILD_SETTINGS)


class KcclSettingWarning(UserWarning):
    """A KCCL_* environment variable that is no KCCL setting (a misspelling is otherwise
    ignored without a word)."""


def _edit_distance(a, b):
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        diag, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            diag, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diag + (ca != cb))
    return row[-1]


def closest_setting(name):
    """The known variable nearest to `name` (within 3 edits, and fewer than half the
    letters after KCCL_; the first in registry order on a tie), else None."""
    best, best_d = None, 4
    for known in KNOWN_NAMES:
        d = _edit_distance(name, known)
        if d < best_d and 2 * d < len(name) - 5:
            best, best_d = known, d
    return best


_warned = set()


def warn_unknown(environ=None):
    """Warns (KcclSettingWarning), once per process and name, about every KCCL_* variable
    that is not a setting; returns those names."""
    import warnings
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith("KCCL_") and k not in KNOWN_NAMES)
    for name in unknown:
        if name in _warned:
            continue
        _warned.add(name)
        near = closest_setting(name)
        hint = f"; did you mean {near}?" if near else ""
        warnings.warn(f"{name} is not a KCCL setting and is ignored{hint} (python -m kccl.config lists them)",
                      KcclSettingWarning, stacklevel=3)
    return unknown


def resolve(overrides: Optional[dict] = None, environ=None):
    """{name: (value, source)} for every setting; source is 'default', 'env' or 'override'.
    overrides may use the variable name (KCCL_TIMEOUT_MS) or the short field name (timeout_ms).
    Unknown KCCL_* variables of the environment are warned about (warn_unknown)."""
    environ = os.environ if environ is None else environ
    warn_unknown(environ)
    by_field = {s.field: s for s in SETTINGS}
    given = {}
    for key, val in (overrides or {}).items():
        s = BY_NAME.get(key) or by_field.get(key)
        if s is None:
            raise KcclInvalidArgument(f"unknown KCCL setting {key!r}; known: {', '.join(BY_NAME)}")
        given[s.name] = val
    out = {}
    for s in SETTINGS:
        if s.name in given:
            raw, src = given[s.name], "override"
        elif environ.get(s.name, "") != "":
            raw, src = environ[s.name], "env"
        else:
            out[s.name] = (s.default, "default")
            continue
        try:
            out[s.name] = (s.parse(raw), src)
        except ValueError as e:
            raise KcclInvalidArgument(f"{s.name}={raw!r}: {e}") from None
    return out


def native(ffi, overrides=None):
    """A filled kcclConfig_t* for kcclCommInitRankConfig."""
    return native_from(ffi, resolve(overrides))


def native_from(ffi, resolved):
    """The kcclConfig_t* of already resolved settings (Python-only ones left out)."""
    cfg = ffi.new("kcclConfig_t *")
    cfg.size = ffi.sizeof("kcclConfig_t")
    for name, (value, _src) in resolved.items():
        s = BY_NAME[name]
        if not s.native:
            continue
        if s.field == "algo":
            value = ALGOS[value]
        elif s.field == "debug":
            value = DEBUG_LEVELS[value]
        setattr(cfg, s.field, value)
    cfg.device = -1  # host transport unless the caller picks a GPU (Communicator(device=...))
    return cfg




def describe(environ=None) -> str:
    environ = os.environ if environ is None else environ
    rows = resolve(environ=environ)
    w = max(len(s.name) for s in SETTINGS)
    lines = [f"{'setting':<{w}}  {'value':>10}  {'source':<8}  meaning"]
    for s in SETTINGS:
        value, src = rows[s.name]
        lines.append(f"{s.name:<{w}}  {str(value):>10}  {src:<8}  {s.doc}")
    for name, default, doc in BUILD_SETTINGS:
        val = environ.get(name, "").strip()
        lines.append(f"{name:<{w}}  {val or default:>10}  {'env' if val else 'default':<8}  {doc}")
    return "\n".join(lines)


def main(argv=None):
    try:
        print(describe())
    except KcclInvalidArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
