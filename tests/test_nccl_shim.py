"""libkccl_nccl.so, NCCL's C interface in front of the real NCCL (issue 27), on a
machine without a GPU: its exported names are exactly the functions it claims, and
against a stand-in NCCL (tests/nccl_fake/fake_nccl.c, which logs what it receives)
every argument and result passes through, and a missing library or function is a
clear NCCL error.  Each case runs in a subprocess: the shim reads KCCL_NCCL_LIB once."""
import json
import os
import subprocess
import sys

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


def run(body, real):
    env = dict(os.environ, SHIM=SHIM)
    env.pop("KCCL_NCCL_LIB", None)
    if real is not None:
        env["KCCL_NCCL_LIB"] = real
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
