"""How many threads a CPU thread pool of this process should run (a BLAS, or any native
pool the engine starts: `choose` knows nothing about what the threads do).

Decode is one vector-matrix product after another, so a rank's speed is its pool's.
OpenBLAS starts one thread per CPU in every process, and its threads meet at the end of
every product; a pool whose threads outnumber the cores it can actually get waits, at
each product, for a thread the scheduler has put aside.  That is why two ranks with a
pool of 2 each on 2 cores ran 13x slower than one rank, and why one busy process beside
a pool of 2 on 2 cores made it 19x slower.  So the count is, in order:

1. the caller's flag (`--threads N` or `--blas-threads N`), else KIE_BLAS_THREADS=N;
2. else OPENBLAS_NUM_THREADS, MKL_NUM_THREADS or OMP_NUM_THREADS as the user set them
   (the library-specific ones first, as OpenBLAS and MKL themselves read them);
3. else the CPUs this rank may run on over the ranks that share them (the rank's own
   cores when the launcher binds ranks apart), capped by the CPUs found idle over a
   short look at /proc/stat (shared among the ranks too) and by a cgroup CPU quota:
   on a machine where other processes keep cores busy, fewer threads that each get a
   core beat more that wait for each other.  At least 1.

The idle CPUs are measured once, at start; contention that begins later is not seen.

set_blas_threads applies a count to the BLAS numpy has already loaded (through
threadpoolctl when it is installed, else through OpenBLAS's or MKL's own
set_num_threads) and to the environment variables a BLAS loaded later reads."""
import ctypes
import math
import os
import time

from .. import settings as _settings

ENV = "KIE_BLAS_THREADS"
# The standard variables, library-specific first: OpenBLAS prefers OPENBLAS_NUM_THREADS
# to OMP_NUM_THREADS, MKL prefers MKL_NUM_THREADS.
STANDARD_VARS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
_ENV_VARS = STANDARD_VARS
# What set_blas_threads wrote into os.environ: a later choose() must not take the
# engine's own value for the user's.
_WRITTEN = {}
IDLE_PROBE_S = 0.15
# An idle share counts as a whole CPU from this much up: a core idle 80 % of the time
# still serves a thread well; one idle half the time does not.
_IDLE_ROUND_UP = 0.2
# OpenBLAS exports these under several prefixes and suffixes (numpy >= 2 wheels bundle
# scipy-openblas, whose symbols are scipy_openblas_*64_), MKL under its own names.
_SETTERS = [(f"{pre}_set_num_threads{suf}", f"{pre}_get_num_threads{suf}")
            for pre in ("scipy_openblas", "openblas") for suf in ("64_", "", "64")]
_SETTERS += [("MKL_Set_Num_Threads", "MKL_Get_Max_Threads")]


def my_cpus():
    return frozenset(os.sched_getaffinity(0))


CPU_MASK_BITS = 8192  # CPUs a rank's affinity can name in cpu_sets_through(); more: not gathered


def cpu_sets_through(comm):
    """The CPU sets of every rank of `comm` (a host kccl.Communicator: its ranks share one
    machine), gathered through it: what node_cpu_sets must be when a caller made the lanes
    without saying, so that two lanes do not both take (and pin to) the same CPUs. None
    when some rank may run on a CPU numbered CPU_MASK_BITS or more (every rank still makes
    the same call)."""
    import numpy as np
    mine = sorted(my_cpus())
    bits = np.zeros(CPU_MASK_BITS + 8, np.uint8)  # the last byte: "a CPU did not fit"
    bits[[c for c in mine if c < CPU_MASK_BITS]] = 1
    bits[CPU_MASK_BITS] = any(c >= CPU_MASK_BITS for c in mine)
    packed = np.packbits(bits)
    every = comm.all_gather(packed)
    sets = [np.flatnonzero(np.unpackbits(row)[:CPU_MASK_BITS]).tolist() for row in every]
    return None if any(np.unpackbits(row)[CPU_MASK_BITS] for row in every) else sets


def plan_threads(mine, everyone):
    """Threads for a rank allowed on CPUs `mine`, when `everyone` lists the CPU sets of
    all ranks of the node (its own included): its CPUs over the ranks that share any of
    them, at least 1."""
    sharing = sum(1 for cpus in everyone if set(cpus) & set(mine))
    return max(1, len(mine) // max(1, sharing))


def parse_override(value, where):
    """A positive thread count from a flag or the environment (settings.py's rule for
    KIE_BLAS_THREADS); None when not given."""
    if value is None or str(value).strip() == "":
        return None
    return _settings.parse_count(value, where)


def parse_standard(value, where):
    """OMP_NUM_THREADS and kin: a positive count, or OpenMP's nested list "4,2" (its first
    level is this pool's); None when empty."""
    if value is None or str(value).strip() == "":
        return None
    return parse_override(str(value).split(",")[0], where)


def override(flag=None, environ=None, flag_name="--blas-threads"):
    """(threads, why) that the user asked for (flag, KIE_BLAS_THREADS, then the standard
    variables), or None; a bad value raises KieError naming where it came from.
    flag_name: the command-line flag that `flag` came from (generate has two)."""
    environ = os.environ if environ is None else environ
    n = parse_override(flag, flag_name)
    if n is not None:
        return n, f"{flag_name} {n}"
    n = _settings.value(ENV, environ)
    if n is not None:
        return n, ENV
    for var in STANDARD_VARS:
        value = environ.get(var)
        if value is None or (environ is os.environ and _WRITTEN.get(var) == value):
            continue
        n = parse_standard(value, var)
        if n is not None:
            return n, f"{var}={value.strip()}"
    return None


def _cpu_ticks(cpus):
    """{cpu: (idle ticks, all ticks)} from /proc/stat for the given CPUs; {} if unreadable."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line[3:4] == " ":
                    continue
                name, *fields = line.split()
                cpu = int(name[3:])
                if cpu in cpus:
                    t = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                    out[cpu] = (t[3] + t[4], sum(t))
    except (OSError, ValueError, IndexError):
        return {}
    return out


def idle_cpus(cpus, seconds=IDLE_PROBE_S):
    """How many of `cpus` sat idle (fractions summed) over `seconds` of sleep; None when
    /proc/stat cannot say (not Linux, or too few ticks elapsed)."""
    before = _cpu_ticks(cpus)
    if not before:
        return None
    time.sleep(seconds)
    after = _cpu_ticks(cpus)
    idle = 0.0
    for cpu, (i0, t0) in before.items():
        if cpu not in after or after[cpu][1] <= t0:
            return None
        i1, t1 = after[cpu]
        idle += min(1.0, max(0.0, (i1 - i0) / (t1 - t0)))
    return idle


def cgroup_cpus(root="/sys/fs/cgroup"):
    """The CPUs a cgroup v2 quota (cpu.max) grants this process, or None when unlimited."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), "/")
        with open(os.path.join(root, rel.lstrip("/"), "cpu.max")) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError, StopIteration):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def choose(flag=None, node_cpu_sets=None, environ=None, idle=None, quota=None, flag_name="--blas-threads"):
    """(threads, why) for a CPU thread pool of this rank, as the module's docstring orders
    it.  node_cpu_sets: the CPU sets of all ranks on this node, this one's included (None:
    this process alone).  idle: the CPUs of this rank found idle (None: measure them now,
    IDLE_PROBE_S of sleep); quota: a CPU quota (None: read the cgroup's).  `why` says which
    rule won, to print beside the count; flag_name: the flag `flag` came from."""
    asked = override(flag, environ, flag_name)
    if asked is not None:
        return asked
    mine = my_cpus()
    everyone = node_cpu_sets if node_cpu_sets is not None else [mine]
    sharing = max(1, sum(1 for cpus in everyone if set(cpus) & mine))
    n = plan_threads(mine, everyone)
    why = f"{len(mine)} CPUs / {sharing} rank{'s' if sharing > 1 else ''}"
    if n == 1:  # nothing to cap: skip the measurement
        return n, why
    quota = cgroup_cpus() if quota is None else quota
    if quota is not None and math.floor(quota / sharing + _IDLE_ROUND_UP) < n:
        n = max(1, math.floor(quota / sharing + _IDLE_ROUND_UP))
        why += f", CPU quota {quota:g}"
    idle = idle_cpus(mine) if idle is None else idle
    if idle is not None and math.floor(idle / sharing + _IDLE_ROUND_UP) < n:
        n = max(1, math.floor(idle / sharing + _IDLE_ROUND_UP))
        why += f", {idle:.1f} of them idle: the machine is busy"
    return n, why


def _loaded_libraries():
    """Paths of the BLAS-like shared libraries mapped into this process."""
    paths = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    paths.add(fields[5].strip())
    except OSError:
        return []
    return sorted(p for p in paths if ".so" in os.path.basename(p) and
                  any(k in os.path.basename(p).lower() for k in ("blas", "mkl")))


def _ctypes_controls():
    """[(path, set_num_threads, get_num_threads)] of the loaded BLAS libraries."""
    out = []
    for path in _loaded_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in _SETTERS:
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                setter, getter = getattr(lib, set_name), getattr(lib, get_name)
                setter.argtypes, setter.restype, getter.restype = [ctypes.c_int], None, ctypes.c_int
                out.append((path, setter, getter))
                break
    return out


def set_blas_threads(n):
    """Applies n threads to every BLAS this process has loaded and to the environment of
    later ones; returns {library: threads it reports now} for the loaded ones."""
    for var in _ENV_VARS:
        os.environ[var] = _WRITTEN[var] = str(n)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        for _path, setter, _getter in _ctypes_controls():
            setter(n)
    else:
        threadpool_limits(limits=n, user_api="blas")
    return blas_threads_now()


def blas_threads_now():
    """{library: threads} of the loaded BLAS libraries, as they report it."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {path: getter() for path, _setter, getter in _ctypes_controls()}
    return {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
