"""What the fuzz tests (tests/test_fuzz_*.py) share: how many examples, and a guard that
turns a hang or an outsized allocation inside a parse into a test failure.

Examples: the default run gives each fuzz test a few hundred (the whole fuzz suite stays
under about a minute on 2 cores); HYPOTHESIS_PROFILE=fuzz-long multiplies them by 20 (a
run of tens of minutes), e.g.
    HYPOTHESIS_PROFILE=fuzz-long python -m pytest -q tests/test_fuzz_*.py"""
import contextlib
import os
import resource
import signal

from hypothesis import settings

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz-long"


def examples(n):
    """Hypothesis settings for a fuzz test of `n` examples in the default run."""
    return settings(max_examples=n * 20 if LONG else n)


class Hang(BaseException):
    """A parse ran past its time: a BaseException so that no `except Exception` in the
    code under test can swallow it."""


def _vm_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def bounded(seconds=10.0, extra_bytes=1 << 30):
    """Runs the body with a time limit (raises Hang; main thread only) and an address-space
    limit of what the process maps now plus `extra_bytes` (an allocation past it raises
    MemoryError, which no parser may let out)."""
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    old_as = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_bytes() + extra_bytes
    if old_as[1] != resource.RLIM_INFINITY:
        limit = min(limit, old_as[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, old_as[1]))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_AS, old_as)


def _on_alarm(signum, frame):
    raise Hang("the parse did not finish in time")
