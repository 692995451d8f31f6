"""libkccl_nccl.so, NCCL's C interface over KCCL (issue 27), on a machine without a
GPU: its exported names are exactly the functions it claims; against a stand-in NCCL
(tests/nccl_fake/fake_nccl.c, which logs what it receives) every argument and result
passes through, and a missing library or function is a clear NCCL error; and with
the stand-in's communicators spanning processes, the shim makes a KCCL communicator
beside each one (KCCL's host transport: the stand-in has no GPU), sends it the small
floating-point all-reduces and forwards the rest, and a dead or aborting rank is a
clear error.  Each case runs in subprocesses: the shim reads its settings once."""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kccl"))
import _build_lib  # noqa: E402

SHIM = os.path.join(ROOT, "kccl", "lib", "libkccl_nccl.so")
pytestmark = pytest.mark.skipif(not os.path.exists(SHIM), reason="libkccl_nccl.so not built (pip install -e .)")

PRELUDE = r"""
import ctypes, json, os, sys
shim = ctypes.CDLL(os.environ["SHIM"])
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
for name in ("ncclGetErrorString", "ncclGetLastError"):
    getattr(shim, name).restype = ctypes.c_char_p
out = {}
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    lib = str(tmp_path_factory.mktemp("fake") / "libfake_nccl.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-I", os.path.join(ROOT, "kccl_native", "nccl"), "-o", lib,
                    os.path.join(ROOT, "tests", "nccl_fake", "fake_nccl.c")], check=True)
    return lib


def run(body, real, env_extra=None):
    env = dict(os.environ, SHIM=SHIM, KCCL_NCCL_ROUTE="0")  # forwarding alone, unless env_extra says otherwise
    env.pop("KCCL_NCCL_LIB", None)
    if real is not None:
        env["KCCL_NCCL_LIB"] = real
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-c", PRELUDE + body + "\nprint(json.dumps(out))"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_shim_exports_exactly_the_functions_it_claims():
    p = subprocess.run(["nm", "-D", "--defined-only", SHIM], capture_output=True, text=True, check=True)
    names = {line.split()[-1] for line in p.stdout.splitlines() if line.strip()}
    claimed = set(_build_lib.nccl_shim_functions(ROOT))
    assert {n for n in names if n.startswith("nccl")} == claimed
    assert names - claimed <= {"_init", "_fini"}  # nothing of the shim's own leaks
    assert {"ncclAllReduce", "ncclCommInitRankConfig", "ncclCommSplit", "ncclGroupEnd", "ncclSend", "ncclRecv",
            "ncclMemAlloc", "ncclCommRegister", "ncclRedOpCreatePreMulSum", "ncclCommGetAsyncError"} <= claimed


def test_every_argument_and_result_reaches_the_real_library(fake):
    out = run(r"""
fake = ctypes.CDLL(os.environ["KCCL_NCCL_LIB"])   # the same loaded copy as the shim's
fake.fake_log.restype = ctypes.c_char_p
v = ctypes.c_int()
out["version_rc"] = shim.ncclGetVersion(ctypes.byref(v)); out["version"] = v.value
uid = UniqueId()
out["uid_rc"] = shim.ncclGetUniqueId(ctypes.byref(uid))
out["uid_sum"] = sum(bytearray(uid))
comm = ctypes.c_void_p()
out["init_rc"] = shim.ncclCommInitRank(ctypes.byref(comm), 4, uid, 3)
out["comm"] = comm.value
shim.ncclGroupStart(); shim.ncclGroupEnd()
out["ar_rc"] = shim.ncclAllReduce(ctypes.c_void_p(0x1000), ctypes.c_void_p(0x2000), ctypes.c_size_t(12345), 9, 2,
                                  comm, ctypes.c_void_p(0x77))
out["ar0_rc"] = shim.ncclAllReduce(None, None, ctypes.c_size_t(0), 7, 0, comm, None)
out["err4"] = shim.ncclGetErrorString(4).decode()
out["last"] = shim.ncclGetLastError(comm).decode()
out["destroy_rc"] = shim.ncclCommDestroy(comm)
out["log"] = fake.fake_log().decode()
""", fake)
    assert out["version_rc"] == 0 and out["version"] == 22805
    assert out["uid_rc"] == 0 and out["init_rc"] == 0 and out["comm"] == 0x1234
    log = out["log"]
    assert f"CommInitRank nranks=4 rank=3 idsum={out['uid_sum']};" in log  # the 128-byte id by value, intact
    assert "GroupStart;GroupEnd;" in log
    assert "AllReduce send=0x1000 recv=0x2000 count=12345 dtype=9 op=2 comm=0x1234 stream=0x77;" in log
    assert out["ar_rc"] == 0 and out["ar0_rc"] == 4  # the real library's result code comes back unchanged
    assert out["err4"] == "fake: invalid argument" and out["last"] == "fake: last error"
    assert out["destroy_rc"] == 0 and "CommDestroy comm=0x1234;" in log


def test_a_function_the_real_library_lacks_is_invalid_usage(fake):
    out = run(r"""
new = ctypes.c_void_p()
out["rc"] = shim.ncclCommSplit(ctypes.c_void_p(0x1234), 0, 0, ctypes.byref(new), None)
out["why"] = shim.ncclGetLastError(None).decode()
v = ctypes.c_int()
out["after"] = shim.ncclGetVersion(ctypes.byref(v))      # the others still work
out["last_after"] = shim.ncclGetLastError(None).decode()  # and the shim's error is cleared
""", fake)
    assert out["rc"] == 5  # ncclInvalidUsage
    assert "ncclCommSplit" in out["why"] and "kccl_nccl" in out["why"]
    assert out["after"] == 0 and out["last_after"] == "fake: last error"


def test_no_real_library_is_a_system_error_that_says_why(tmp_path):
    missing = str(tmp_path / "nowhere" / "libnccl.so.2")
    out = run(r"""
v = ctypes.c_int()
out["rc"] = shim.ncclGetVersion(ctypes.byref(v))
out["why"] = shim.ncclGetLastError(None).decode()
out["str"] = shim.ncclGetErrorString(2).decode()
out["rc2"] = shim.ncclAllReduce(None, None, ctypes.c_size_t(1), 7, 0, None, None)
""", missing)
    assert out["rc"] == 2 and out["rc2"] == 2  # ncclSystemError, every call, no crash
    assert "cannot load the real NCCL" in out["why"] and missing in out["why"] and "ncclGetVersion" in out["why"]
    assert "could not be loaded" in out["str"]


def test_the_shim_as_its_own_real_library_is_refused():
    out = run(r"""
v = ctypes.c_int()
out["rc"] = shim.ncclGetVersion(ctypes.byref(v))
out["why"] = shim.ncclGetLastError(None).decode()
""", SHIM)
    assert out["rc"] == 2 and "names this shim" in out["why"]


def test_kccl_paths_names_the_shim():
    p = subprocess.run([sys.executable, "-m", "kccl.paths", "--nccl-shim"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and os.path.samefile(p.stdout.strip(), SHIM)
    assert json.dumps(_build_lib.nccl_shim_functions(ROOT))  # the list parses


# ------------------------------------------------------------------------------ routing to KCCL

RANK_PRELUDE = r"""
import ctypes, json, os, signal, struct, sys, time
shim = ctypes.CDLL(os.environ["SHIM"])
fake = ctypes.CDLL(os.environ["KCCL_NCCL_LIB"])
fake.fake_log.restype = ctypes.c_char_p
shim.ncclGetLastError.restype = ctypes.c_char_p
rank, nranks = int(os.environ["RANK"]), int(os.environ["NRANKS"])
uid = ctypes.create_string_buffer(128)
idfile = os.environ["IDFILE"]
if rank == 0:
    assert shim.ncclGetUniqueId(uid) == 0
    with open(idfile + ".tmp", "wb") as f:
        f.write(uid.raw)
    os.rename(idfile + ".tmp", idfile)
else:
    while not os.path.exists(idfile):
        time.sleep(0.01)
    uid.raw = open(idfile, "rb").read()
class Id(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
comm = ctypes.c_void_p()
if os.environ.get("IN_GROUP"):  # as PyTorch makes its communicators
    assert shim.ncclGroupStart() == 0
out = {"init": shim.ncclCommInitRank(ctypes.byref(comm), nranks, Id.from_buffer_copy(uid.raw), rank)}
if os.environ.get("IN_GROUP"):
    out["group_log"] = fake.fake_log().decode()   # the KCCL side waits for the group's end
    out["group_end"] = shim.ncclGroupEnd()
out["init_log"] = fake.fake_log().decode()
fake.fake_clear()
def allreduce(values, ctype, dtype, op=0, inplace=False):
    send = (ctype * len(values))(*values)
    recv = send if inplace else (ctype * len(values))()
    rc = shim.ncclAllReduce(send, recv, ctypes.c_size_t(len(values)), dtype, op, comm, None)
    return rc, list(recv)
def logged():
    text = fake.fake_log().decode()
    fake.fake_clear()
    return text
"""


def run_ranks(body, fake, tmp_path, nranks=3, env=None, per_rank_env=None, timeout=60):
    """Runs RANK_PRELUDE + body in nranks processes; their `out` dicts, by rank."""
    procs = []
    for r in range(nranks):
        e = dict(os.environ, SHIM=SHIM, KCCL_NCCL_LIB=fake, FAKE_NCCL_DIR=str(tmp_path), RANK=str(r),
                 NRANKS=str(nranks), IDFILE=str(tmp_path / "uid"))
        e.update(env or {})
        e.update((per_rank_env or {}).get(r, {}))
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_PRELUDE + body + "\nprint(json.dumps(out))"],
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, so, se))
    return outs


def kccl_segments():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("kccl-")) if os.path.isdir("/dev/shm") else []


def parsed(outs):
    res = []
    for rc, so, se in outs:
        assert rc == 0, se
        res.append(dict(json.loads(so.strip().splitlines()[-1]), stderr=se))
    return res


def test_small_float_all_reduces_go_to_kccl_and_the_rest_to_nccl(fake, tmp_path):
    before = kccl_segments()
    outs = parsed(run_ranks(r"""
n = 300
out["f32"] = allreduce([float(rank * 1000 + i) for i in range(n)], ctypes.c_float, 7)
out["f32_log"] = logged()
out["max_inplace"] = allreduce([float((rank * 7 + i) % 5) for i in range(n)], ctypes.c_float, 7, op=2, inplace=True)
out["avg"] = allreduce([float(rank + 1)] * 8, ctypes.c_float, 7, op=4)
out["bf16"] = allreduce([0x3F80 + 0x80 * rank] * 4, ctypes.c_uint16, 9)   # 1.0, 2.0, 4.0 (bfloat16 bits)
out["small_log"] = logged()
out["big"] = allreduce([1.0] * 1100, ctypes.c_float, 7)                     # 4400 bytes > KCCL_NCCL_ROUTE_MAX_BYTES
out["big_log"] = logged()
out["i64"] = allreduce([rank, 5], ctypes.c_int64, 4)                         # an integer type: NCCL
out["i64_log"] = logged()
shim.ncclGroupStart()
out["grouped"] = allreduce([1.0, 2.0], ctypes.c_float, 7)                    # inside a group: NCCL
shim.ncclGroupEnd()
out["grouped_log"] = logged()
e = ctypes.c_int(-1)
out["async"] = [shim.ncclCommGetAsyncError(comm, ctypes.byref(e)), e.value]
out["destroy"] = shim.ncclCommDestroy(comm)
""", fake, tmp_path, env={"KCCL_NCCL_ROUTE_MAX_BYTES": "4096", "KCCL_DEBUG": "INFO"}))
    n = 300
    for r, o in enumerate(outs):
        assert o["init"] == 0, o["stderr"]
        # the KCCL side was made through the stand-in: agreement (int64 min), rank 0's id, agreement again
        assert o["init_log"].count("dtype=4 op=3") == 2 and "Broadcast count=128 root=0;" in o["init_log"]
        assert o["f32"] == [0, [float(3000 + 3 * i) for i in range(n)]]
        assert o["max_inplace"] == [0, [float(max((q * 7 + i) % 5 for q in range(3))) for i in range(n)]]
        assert o["avg"] == [0, [2.0] * 8]
        assert o["bf16"] == [0, [0x40E0] * 4]                                  # 7.0
        assert "AllReduce" not in o["f32_log"] + o["small_log"]                # KCCL took them
        assert o["big"] == [0, [3.0] * 1100] and "count=1100 dtype=7" in o["big_log"]
        assert o["i64"] == [0, [3, 15]] and "count=2 dtype=4 op=0" in o["i64_log"]
        assert o["grouped"] == [0, [3.0, 6.0]] and "count=2 dtype=7" in o["grouped_log"]
        assert o["async"] == [0, 0] and o["destroy"] == 0
        assert "stays with the real NCCL" not in o["stderr"]
        assert f"kccl_nccl: rank {r} of 3: 4 all-reduces went to KCCL, 3 to the real NCCL (destroy)" in o["stderr"]
    assert kccl_segments() == before


def test_a_communicator_made_inside_a_group_gets_its_kccl_side_at_the_group_end(fake, tmp_path):
    outs = parsed(run_ranks(r"""
out["f32"] = allreduce([float(rank)] * 5, ctypes.c_float, 7)
out["log"] = logged()
shim.ncclCommDestroy(comm)
""", fake, tmp_path, nranks=2, env={"IN_GROUP": "1", "KCCL_DEBUG": "INFO"}))
    for r, o in enumerate(outs):
        assert o["init"] == 0 and o["group_end"] == 0
        assert "Broadcast" not in o["group_log"] and "AllReduce" not in o["group_log"]
        assert "Broadcast count=128 root=0;" in o["init_log"]                 # made after GroupEnd
        assert o["f32"] == [0, [1.0] * 5] and "AllReduce" not in o["log"]
        assert f"rank {r} of 2: 1 all-reduces went to KCCL" in o["stderr"]


def test_ranks_that_differ_in_the_route_limit_all_stay_with_nccl(fake, tmp_path):
    outs = parsed(run_ranks(r"""
out["f32"] = allreduce([1.0, 2.0], ctypes.c_float, 7)
out["log"] = logged()
shim.ncclCommDestroy(comm)
""", fake, tmp_path, nranks=2, per_rank_env={1: {"KCCL_NCCL_ROUTE_MAX_BYTES": "1k"}}))
    for o in outs:
        assert o["init"] == 0 and o["f32"] == [0, [2.0, 4.0]]
        assert "count=2 dtype=7" in o["log"]                                   # every rank forwarded it
        assert "stays with the real NCCL only" in o["stderr"] and "KCCL_NCCL_ROUTE_MAX_BYTES" in o["stderr"]


def test_ranks_on_different_hosts_stay_with_nccl_at_once(fake, tmp_path):
    t0 = time.monotonic()
    outs = parsed(run_ranks(r"""
out["f32"] = allreduce([1.0, 2.0], ctypes.c_float, 7)
out["log"] = logged()
shim.ncclCommDestroy(comm)
""", fake, tmp_path, nranks=2, env={"KCCL_TIMEOUT_MS": "30000"},
        per_rank_env={0: {"KCCL_HOST_ID": "a"}, 1: {"KCCL_HOST_ID": "b"}}))
    assert time.monotonic() - t0 < 20  # not KCCL's init timing out
    for o in outs:
        assert o["init"] == 0 and o["f32"] == [0, [2.0, 4.0]]
        assert "count=2 dtype=7" in o["log"]                                   # every rank forwarded it
        assert "stays with the real NCCL only" in o["stderr"] and "more than one host" in o["stderr"]


def test_route_off_makes_no_kccl_side(fake, tmp_path):
    outs = parsed(run_ranks(r"""
out["f32"] = allreduce([1.0], ctypes.c_float, 7)
out["log"] = logged()
shim.ncclCommDestroy(comm)
""", fake, tmp_path, nranks=2, env={"KCCL_NCCL_ROUTE": "0"}))
    for o in outs:
        assert o["init"] == 0 and "Broadcast" not in o["init_log"] and "AllReduce" not in o["init_log"]
        assert o["f32"] == [0, [2.0]] and "count=1 dtype=7" in o["log"]


def test_a_bad_route_setting_is_an_invalid_argument_before_any_communicator(fake, tmp_path):
    out = run(r"""
comm = ctypes.c_void_p()
uid = UniqueId()
shim.ncclGetUniqueId(ctypes.byref(uid))
out["rc"] = shim.ncclCommInitRank(ctypes.byref(comm), 2, uid, 0)
out["why"] = shim.ncclGetLastError(None).decode()
fake = ctypes.CDLL(os.environ["KCCL_NCCL_LIB"]); fake.fake_log.restype = ctypes.c_char_p
out["log"] = fake.fake_log().decode()
""", fake, env_extra={"KCCL_NCCL_ROUTE": "1", "KCCL_NCCL_ROUTE_MAX_BYTES": "lots"})
    assert out["rc"] == 4 and "KCCL_NCCL_ROUTE_MAX_BYTES=lots" in out["why"]
    assert "CommInitRank" not in out["log"]                                    # refused before the real init


@pytest.mark.parametrize("how", ["kill", "abort"])
def test_a_dead_or_aborting_rank_is_a_remote_error_within_two_seconds(fake, tmp_path, how):
    before = kccl_segments()
    outs = run_ranks(r"""
how = os.environ["HOW"]
t_fail, rc, i = None, 0, 0
while i < 100000:
    if rank == 2 and i == 200:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        out["abort"] = shim.ncclCommAbort(comm)
        break
    t0 = time.monotonic()
    rc, got = allreduce([1.0] * 16, ctypes.c_float, 7)
    if rc != 0:
        t_fail = time.monotonic() - t0
        break
    assert got == [3.0] * 16, got
    i += 1
out.update(rc=rc, calls=i, seconds=t_fail, why=shim.ncclGetLastError(comm).decode())
e = ctypes.c_int(0)
out["async"] = [shim.ncclCommGetAsyncError(comm, ctypes.byref(e)), e.value]
if rank != 2:
    out["abort"] = shim.ncclCommAbort(comm)
""", fake, tmp_path, env={"HOW": how})
    whys = []
    for r, (rc, so, se) in enumerate(outs):
        if r == 2 and how == "kill":
            assert rc == -9
            continue
        assert rc == 0, se
        o = json.loads(so.strip().splitlines()[-1])
        assert o["init"] == 0 and o["abort"] == 0
        if r == 2:
            continue
        assert o["calls"] >= 200 and o["rc"] == 6, o                            # ncclRemoteError
        assert o["seconds"] < 2.0 and "kccl_nccl" in o["why"], o
        assert o["async"] == [0, 6]
        whys.append(o["why"])
    # the survivor that noticed first names rank 2; the other may name that survivor, which left on the error
    assert any("rank 2" in w for w in whys), whys
    assert kccl_segments() == before
