"""BLAS threads per rank.

Decode is one vector-matrix product after another, so a rank's speed is its BLAS's.
OpenBLAS starts one thread per CPU in every process; with N ranks on a node that is N
pools on the same cores, whose threads spin while waiting for work and take the cores
from each other (TP = 2 on 2 cores ran 13x slower than TP = 1 that way).  So each rank
gives its BLAS the CPUs it may run on divided by the ranks that share them:
cores / ranks on the node when the launcher does not bind, and the rank's own cores
when it binds each rank apart.  `--blas-threads N` or KIE_BLAS_THREADS=N overrides.

The count is applied to the BLAS numpy has already loaded (through threadpoolctl when
it is installed, else through OpenBLAS's or MKL's own set_num_threads) and to the
environment variables a BLAS loaded later reads."""
import ctypes
import os

from .errors import KieError

ENV = "KIE_BLAS_THREADS"
_ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# OpenBLAS exports these under several prefixes and suffixes (numpy >= 2 wheels bundle
# scipy-openblas, whose symbols are scipy_openblas_*64_), MKL under its own names.
_SETTERS = [(f"{pre}_set_num_threads{suf}", f"{pre}_get_num_threads{suf}")
            for pre in ("scipy_openblas", "openblas") for suf in ("64_", "", "64")]
_SETTERS += [("MKL_Set_Num_Threads", "MKL_Get_Max_Threads")]


def my_cpus():
    return frozenset(os.sched_getaffinity(0))


def plan_threads(mine, everyone):
    """Threads for a rank allowed on CPUs `mine`, when `everyone` lists the CPU sets of
    all ranks of the node (its own included): its CPUs over the ranks that share any of
    them, at least 1."""
    sharing = sum(1 for cpus in everyone if set(cpus) & set(mine))
    return max(1, len(mine) // max(1, sharing))


def parse_override(value, where):
    """A positive thread count from a flag or the environment; None when not given."""
    if value is None or str(value).strip() == "":
        return None
    text = str(value).strip()
    # ASCII digits only (str.isdigit also takes '²', which int() refuses), and a count a
    # BLAS's C int holds
    if not (text.isascii() and text.isdigit() and len(text) <= 6) or int(text) < 1:
        raise KieError(f"{where}={value!r}: expected a positive number of BLAS threads per rank")
    return int(text)


def choose(flag=None, node_cpu_sets=None, environ=None):
    """(threads, why): the flag, else KIE_BLAS_THREADS, else plan_threads over the CPU sets
    of the ranks on this node (None: this process alone)."""
    environ = os.environ if environ is None else environ
    n = parse_override(flag, "--blas-threads")
    if n is not None:
        return n, "--blas-threads"
    n = parse_override(environ.get(ENV), ENV)
    if n is not None:
        return n, ENV
    mine = my_cpus()
    everyone = node_cpu_sets if node_cpu_sets is not None else [mine]
    return plan_threads(mine, everyone), f"{len(mine)} CPUs / {sum(1 for c in everyone if set(c) & mine)} ranks"


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
        os.environ[var] = str(n)
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
