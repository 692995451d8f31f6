"""Fuzzing settings strings and the bytes of a kccl.UniqueId.

Settings: every KCCL_* value is parsed twice, by kccl/config.py (Python) and by
kccl_native/src/config.c (C, kcclConfigInit reading the environment).  For any string,
both must agree: the same value, or both refuse it (KcclInvalidArgument naming the
variable).  KIE's own settings (KIE_BLAS_THREADS, the MPI launcher's rank variables)
must give a KieError or a value.

UniqueId: bytes that did not come from get_unique_id (random, flipped, forged with a
valid checksum, unpickled from a tampered pickle) give a typed error at construction
or at Communicator init; an id naming a segment planted in /dev/shm, smaller than its
header claims, is refused at init instead of faulting at the first collective (run in a
subprocess, since the failure this guards against is a SIGBUS).

Run longer: HYPOTHESIS_PROFILE=fuzz-long (see tests/_fuzz.py)."""
import os
import pickle
import struct
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, strategies as st

import kccl
from kccl import config as kconfig
from kccl._native import ffi, lib

from _fuzz import examples

INT_SETTINGS = [s for s in kconfig.SETTINGS if s.native and s.field not in kconfig._CHOICES]
CHOICE_SETTINGS = [s for s in kconfig.SETTINGS if s.native and s.field in kconfig._CHOICES]

blank = st.sampled_from(["", " ", "\t", "\n", "\v", "\f", "\r", "\u00a0", "\u2003", "\x1c"])
number = st.one_of(st.integers(-2**70, 2**70).map(str), st.sampled_from(["0", "-0", "+1", "00000000001", "1_000",
                                                                         "0x10", "1e3", "١٢", "²", "1.5"]),
                   st.integers(0, 80).map(lambda n: "0" * n + "1"))
suffix = st.sampled_from(["", "k", "K", "m", "M", "g", "kk", "KiB", " k"])
values = st.one_of(st.builds(lambda a, n, s, b: a + n + s + b, blank, number, suffix, blank),
                   st.text(max_size=12).filter(lambda t: "\0" not in t),
                   st.sampled_from(["auto", "ONESHOT", "twoShot", "0", "1", "2", "3", "\u212auto", "oneshot "]))


def _c_parse(name, text):
    """(ok, value of the setting) as kcclConfigInit reads it from the environment."""
    old = os.environ.get(name)
    os.environ[name] = text
    try:
        cfg = ffi.new("kcclConfig_t *")
        rc = lib.kcclConfigInit(cfg)
        s = kconfig.BY_NAME[name]
        return rc == 0, getattr(cfg, s.field) if rc == 0 else ffi.string(lib.kcclGetLastError(ffi.NULL)).decode()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _py_parse(name, text):
    try:
        value, _src = kconfig.resolve(environ={name: text})[name]
    except kccl.KcclInvalidArgument as e:
        assert name in str(e), str(e)
        return False, str(e)
    s = kconfig.BY_NAME[name]
    return True, kconfig._CHOICES[s.field][value] if s.field in kconfig._CHOICES else value


@examples(300)
@given(setting=st.sampled_from(INT_SETTINGS + CHOICE_SETTINGS), text=values)
def test_python_and_c_parse_settings_alike(setting, text):
    py, c = _py_parse(setting.name, text), _c_parse(setting.name, text)
    assert py[0] == c[0], (setting.name, text, py, c)
    if py[0]:
        assert py[1] == c[1], (setting.name, text, py, c)
    else:
        assert setting.name in c[1], c


@pytest.mark.parametrize("text", ["0" * 300 + "4096", "17592186044417M", "9007199254740993k", " \t ", "\u00a04096"])
def test_settings_found_by_fuzzing(text):
    """Values the two parsers used to disagree on: C cut long values short at its buffer (70
    zeros then 4096 read as 0 with the 64-byte buffer of then), wrapped the k/M
    multiplication (2^44 + 1 M became 1 M), and Python stripped Unicode blanks and refused
    blank values that C took as unset."""
    name = "KCCL_BUFFER_BYTES"
    py, c = _py_parse(name, text), _c_parse(name, text)
    assert py[0] == c[0], (text, py, c)
    if py[0]:
        assert py[1] == c[1]


@examples(100)
@given(text=values)
def test_kie_blas_threads(text):
    from kie_engine.errors import KieError
    from kie_engine.lanes.threads import parse_override
    try:
        n = parse_override(text, "KIE_BLAS_THREADS")
    except KieError as e:
        assert "KIE_BLAS_THREADS" in str(e)
        return
    assert n is None or 1 <= n < 10**6


@pytest.mark.parametrize("size,rank", [("2", "x"), ("abc", "0"), ("2", "5"), ("0", "0"), ("²", "0")])
def test_kie_launcher_variables(size, rank):
    env = dict(os.environ, PMI_SIZE=size, PMI_RANK=rank)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "kie_engine", "generate", "--model", "none.gguf", "--prompt", "x"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "PMI_SIZE" in p.stderr and "Traceback" not in p.stderr, p.stderr


# -- unique ids -----------------------------------------------------------------------------------

def _fnv1a(b, h=0xcbf29ce484222325):
    for x in b:
        h = ((h ^ x) * 0x100000001b3) & (2**64 - 1)
    return h


def forged(token=None, version=None, tail=b""):
    """An id with a valid checksum, as anyone who read uniqueid.c could make: the checksum
    (bytes 40-47) covers bytes 0-39 and the machine key (48-55); `tail` goes after them,
    where a real id holds zeros."""
    b = bytearray(kccl.get_unique_id())
    if token is not None:
        b[16:32] = token
    if version is not None:
        b[8:12] = struct.pack("<I", version)
    b[56:56 + len(tail)] = tail
    b[40:48] = struct.pack("<Q", _fnv1a(bytes(b[48:56]), _fnv1a(bytes(b[:40]))))
    return bytes(b)


@examples(100)
@given(data=st.binary(min_size=0, max_size=300))
def test_unique_id_from_any_bytes(data):
    try:
        uid = kccl.UniqueId(data)
    except kccl.KcclInvalidArgument:
        assert len(data) != 128
        return
    with pytest.raises((kccl.KcclInvalidArgument, kccl.KcclInvalidUsage)):
        kccl.Communicator(1, uid, 0, config={"timeout_ms": 500})


@examples(60)
@given(version=st.integers(0, 2**32 - 1), tail=st.binary(max_size=72))
def test_forged_unique_ids(version, tail):
    uid = forged(version=version, tail=tail)
    code = lib.KCCL_VERSION_CODE if hasattr(lib, "KCCL_VERSION_CODE") else None
    if tail.strip(b"\0") or (code is not None and version != code):
        with pytest.raises((kccl.KcclInvalidArgument, kccl.KcclInvalidUsage)):
            kccl.Communicator(1, uid, 0, config={"timeout_ms": 500})
    else:  # a well-formed id: indistinguishable from a real one, and it works
        try:
            with kccl.Communicator(1, uid, 0, config={"timeout_ms": 500}) as c:
                c.barrier()
        except kccl.KcclInvalidUsage as e:
            assert "version" in str(e)


@examples(60)
@given(cut=st.integers(0, 200), junk=st.binary(max_size=8))
def test_tampered_unique_id_pickles(cut, junk):
    raw = pickle.dumps(kccl.get_unique_id())
    i = raw.index(b"KCCLUID1")
    tampered = raw[:i] + raw[i:i + 128][:cut] + junk + raw[i + 128:]
    try:
        uid = pickle.loads(tampered)
    except kccl.KcclInvalidArgument:
        return
    except (pickle.UnpicklingError, EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError,
            struct.error, OverflowError, MemoryError):
        return  # pickle refuses it (unpickling untrusted data is never safe: ids travel over trusted channels)
    if isinstance(uid, kccl.UniqueId):  # a UniqueId is never of the wrong length
        assert len(uid) == 128
    else:  # the pickle stopped early and gave something else: refused, or (the whole id) it works
        try:
            kccl.Communicator(1, uid, 0, config={"timeout_ms": 500}).close()
        except (kccl.KcclInvalidArgument, kccl.KcclInvalidUsage):
            pass


PLANTED = textwrap.dedent("""
    import os, struct, sys, threading, time
    import numpy as np
    import kccl
    uid = kccl.get_unique_id()
    token = bytes(uid)[16:32].hex()
    out = {}

    def rank0():
        try:
            out["comm"] = kccl.Communicator(2, uid, 0, config={"timeout_ms": 5000})
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=rank0)
    t.start()
    mine = f"/dev/shm/kccl-{token}-0"
    while True:  # rank 0's segment, header complete
        try:
            with open(mine, "rb") as f:
                head = f.read(4096)
            if head[:8] == struct.pack("<Q", 0x4b43434c5345474d):
                break
        except OSError:
            pass
        time.sleep(0.01)
    h = bytearray(head)
    h[16:20] = struct.pack("<I", 1)        # rank 1
    h[68:72] = struct.pack("<I", 1)        # 'mapped': as if rank 1 had mapped everyone
    planted = f"/dev/shm/kccl-{token}-1"
    with open(planted, "wb") as f:         # one page, where the header promises the whole segment
        f.write(bytes(h))
    t.join()
    os.unlink(planted)
    if "error" in out:
        print("refused:", type(out["error"]).__name__, out["error"])
        sys.exit(0)
    comm = out["comm"]
    x = np.ones(1 << 16, np.float32)
    try:
        comm.all_reduce(x)
    except kccl.KcclError as e:
        print("collective failed:", e)
    comm.abort()
    sys.exit(1)
""")


def test_unique_id_naming_a_planted_segment():
    p = subprocess.run([sys.executable, "-c", PLANTED], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-2000:])
    assert "refused: KcclInvalidUsage" in p.stdout and "not a KCCL segment" in p.stdout, p.stdout
