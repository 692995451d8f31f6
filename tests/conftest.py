"""Fixtures shared by the KCCL tests.

* `group` (module scope, parametrized over 1, 2, 3, 4 and 8 ranks): a communicator
  group of real spawned worker processes (see _harness.py).  All groups live on one
  session farm of 8 workers, so a hypothesis run of hundreds of examples costs one
  spawn per worker for the whole session.
* `spawn_farm`: a fresh farm for tests that kill workers; killed at teardown.
* `comm1` / `comm_pair`: communicators inside the test process (1 rank; 2 ranks whose
  init runs in two threads) for argument checks that never reach a peer.
* autouse: no test may leave a /dev/shm/kccl-* name behind.
"""
import os
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

import kccl  # noqa: E402
from _harness import FarmManager, Farm, GroupHandle, shm_entries  # noqa: E402

# No example database: it would be written outside tests/ and replay old failures.
settings.register_profile("kccl", database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# The fuzz tests' long run (tests/_fuzz.py multiplies their examples by 20 under it).
settings.register_profile("fuzz-long", parent=settings.get_profile("kccl"))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kccl"))

NRANKS = (1, 2, 3, 4, 8)


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    """Every test: no /dev/shm/kccl-* entry that was not there before (names of a
    communicator being set up by someone else vanish within moments, so wait a little)."""
    before = shm_entries()
    yield
    deadline = time.monotonic() + 3.0
    while True:
        new = shm_entries() - before
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not new, f"left behind in /dev/shm: {sorted(new)}"


@pytest.fixture(scope="session")
def farms():
    manager = FarmManager(max(NRANKS))
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module", params=NRANKS, ids=lambda n: f"{n}ranks")
def group(request, farms):
    """A GroupHandle: .run(task, **kw) runs a _harness task on every rank; .n ranks."""
    return GroupHandle(farms, request.param)


@pytest.fixture
def spawn_farm():
    """make(n) -> a fresh Farm of n workers (bfloat16-less for a fast start); all killed at teardown."""
    made = []

    def make(n):
        f = Farm(n, block_ml_dtypes=True)
        made.append(f)
        return f

    yield make
    for f in made:
        f.kill_all()


@pytest.fixture
def comm1():
    c = kccl.Communicator(1, kccl.get_unique_id(), 0, config={"timeout_ms": 5000})
    yield c
    c.close()


def make_pair(timeout_ms=3000, config=None):
    """Two ranks of one communicator in this process (init of rank 0 runs in a thread);
    config: further settings for both."""
    uid = kccl.get_unique_id()
    out, err = {}, {}
    cfg = {"timeout_ms": timeout_ms, **(config or {})}

    def rank0():
        try:
            out[0] = kccl.Communicator(2, uid, 0, config=cfg)
        except BaseException as e:  # noqa: BLE001
            err[0] = e

    t = threading.Thread(target=rank0)
    t.start()
    c1 = kccl.Communicator(2, uid, 1, config=cfg)
    t.join()
    if err:
        c1.close()
        raise err[0]
    return out[0], c1


@pytest.fixture
def comm_pair():
    c0, c1 = make_pair()
    yield c0, c1
    c0.close()
    c1.close()
