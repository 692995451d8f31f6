"""The KCCL_* settings: one table (kccl_settings.def) read by kccl/config.py and by C
(kcclConfigInit), the same defaults and parsing in both, printable with `python -m
kccl.config`, invalid values refused."""
import json
import re
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kccl
from kccl import config as kconfig

# kcclConfig_t int fields given as names in Python
NAME_MAPS = {"algo": kconfig.ALGOS, "debug": kconfig.DEBUG_LEVELS, "slot_stores": kconfig.SLOT_STORES}


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCCL_")}
    env.update(extra)
    return env


def run_py(code, env, timeout=60):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


# Runs in a subprocess: C's kcclConfigInit under given environments, without importing
# ml_dtypes (1 s).  Prints JSON: [[rc, {field: value}], ...] for each env in sys.argv[1].
C_PROBE = textwrap.dedent("""
    import json, os, sys
    sys.modules["ml_dtypes"] = None
    from kccl._native import ffi, lib
    out = []
    for env in json.loads(sys.argv[1]):
        for k in [k for k in os.environ if k.startswith("KCCL_")]:
            del os.environ[k]
        os.environ.update(env)
        cfg = ffi.new("kcclConfig_t *")
        rc = lib.kcclConfigInit(cfg)
        fields = {name: getattr(cfg, name) for name, _ in ffi.typeof("kcclConfig_t").fields}
        out.append([rc, fields, ffi.string(lib.kcclGetLastError(ffi.NULL)).decode()])
    print(json.dumps(out))
""")


_C_CACHE = {}


def c_config(envs):
    """[(rc, fields, last_error)] of kcclConfigInit under each env (a KCCL_*-free subprocess;
    every env this module needs is probed by the first call, in one subprocess)."""
    keys = [json.dumps(e, sort_keys=True) for e in envs]
    missing = [k for k in keys if k not in _C_CACHE]
    if missing:
        todo = sorted(set(missing) | {json.dumps(e, sort_keys=True) for e in _all_probe_envs()} - set(_C_CACHE))
        p = subprocess.run([sys.executable, "-c", C_PROBE, json.dumps([json.loads(k) for k in todo])],
                           env=clean_env(), capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        _C_CACHE.update(zip(todo, json.loads(p.stdout)))
    return [_C_CACHE[k] for k in keys]


def _all_probe_envs():
    cases = BAD_ENV + AGREE + DISAGREE
    return [{}, {"KCCL_ALGO": "", "KCCL_TIMEOUT_MS": ""}] + [{n: v} for n, v in cases]


def test_python_m_kccl_config_lists_every_setting():
    p = subprocess.run([sys.executable, "-m", "kccl.config"], env=clean_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "Warning" not in p.stderr, p.stderr  # e.g. runpy's, if the package imported kccl.config first
    for s in kconfig.SETTINGS:
        line = [ln for ln in p.stdout.splitlines() if ln.startswith(s.name + " ")]
        assert line, f"{s.name} missing from `python -m kccl.config`:\n{p.stdout}"
        assert str(s.default) in line[0] and "default" in line[0], line[0]
    assert len(kconfig.SETTINGS) == len({s.name for s in kconfig.SETTINGS}) >= 7


def test_python_m_kccl_config_shows_env_and_rejects_bad_env():
    p = subprocess.run([sys.executable, "-m", "kccl.config"], env=clean_env(KCCL_TIMEOUT_MS="1234"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("KCCL_TIMEOUT_MS ")]
    assert "1234" in line and "env" in line
    p = subprocess.run([sys.executable, "-m", "kccl.config"], env=clean_env(KCCL_ALGO="bogus"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "KCCL_ALGO" in p.stderr and "bogus" in p.stderr


def test_registry_fields_match_the_c_struct():
    from kccl._native import ffi
    # device is the Communicator's argument (which GPU), not an environment setting
    c_fields = {name for name, _ in ffi.typeof("kcclConfig_t").fields} - {"size", "device"}
    assert {s.field for s in kconfig.SETTINGS if s.native} == c_fields
    assert all(s.name == "KCCL_" + s.field.upper() for s in kconfig.SETTINGS)
    # the Python-only settings are the placement ones, which C gets as a kcclPlacement_t, and
    # those of communicators over several hosts (kccl/hierarchical.py)
    assert {s.name for s in kconfig.SETTINGS if not s.native} == {"KCCL_TOPO", "KCCL_TOPO_FILE", "KCCL_HOST_ID",
                                                                   "KCCL_HIER_LARGE_BYTES", "KCCL_HIER_CHECK"}


def test_c_defaults_equal_python_defaults():
    ((rc, fields, _err),) = c_config([{}])
    assert rc == 0
    for s in (s for s in kconfig.SETTINGS if s.native):
        want = NAME_MAPS[s.field][s.default] if s.field in NAME_MAPS else s.default
        assert fields[s.field] == want, f"{s.name}: C default {fields[s.field]!r}, Python registry {s.default!r}"
    # and the Python resolution of an empty environment is the registry's defaults
    assert {k: v for k, (v, src) in kconfig.resolve(environ={}).items()} == {s.name: s.default for s in kconfig.SETTINGS}


BAD_ENV = [("KCCL_ALGO", "bogus"), ("KCCL_ALGO", "one-shot"), ("KCCL_TIMEOUT_MS", "-5"), ("KCCL_TIMEOUT_MS", "abc"),
           ("KCCL_TIMEOUT_MS", "1.5"), ("KCCL_TIMEOUT_MS", "86400001"), ("KCCL_BUFFER_BYTES", "100"),
           ("KCCL_BUFFER_BYTES", "2G"), ("KCCL_BUFFER_BYTES", "lots"), ("KCCL_CHUNK_BYTES", "4000"), ("KCCL_CHUNK_BYTES", "2k"), ("KCCL_ONESHOT_MAX_BYTES", "-1"),
           ("KCCL_SPIN_US", "-2"), ("KCCL_YIELD_US", "x"), ("KCCL_DEBUG", "LOUD"), ("KCCL_DEBUG", "4"),
           ("KCCL_GPU_FLAG_REPLICAS", "2"), ("KCCL_GPU_FLAG_REPLICAS", "on"), ("KCCL_GPU_BLOCKS", "133"),
           ("KCCL_GPU_BLOCKS", "-1"), ("KCCL_GPU_PULL", "2"), ("KCCL_GPU_CARVEOUT", "101"),
           ("KCCL_GPU_CARVEOUT", "-2"), ("KCCL_GPU_LL_THREADS", "48"), ("KCCL_GPU_LL_THREADS", "0"),
           ("KCCL_GPU_LL_THREADS", "288"), ("KCCL_GPU_LL_HOPS", "3"), ("KCCL_GPU_LL_HOPS", "-1"),
           ("KCCL_GPU_LL_HOPS", "two"), ("KCCL_GPU_CHUNK_THREADS", "100"), ("KCCL_GPU_CHUNK_THREADS", "800"),
           ("KCCL_GPU_CHUNK_THREADS", "-32")]


@pytest.mark.parametrize("name,value", BAD_ENV)
def test_invalid_env_refused_by_communicator(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(kccl.KcclInvalidArgument, match=name) as ei:
        kccl.Communicator(1, kccl.get_unique_id(), 0)
    assert repr(value) in str(ei.value) or value in str(ei.value)


@pytest.mark.parametrize("name,value", BAD_ENV)
def test_invalid_env_refused_by_c(name, value):
    ((rc, _fields, err),) = c_config([{name: value}])
    assert rc == 4 and name in err, (rc, err)  # kcclInvalidArgument


@pytest.mark.parametrize("overrides", [{"algo": "bogus"}, {"KCCL_TIMEOUT_MS": -5}, {"timeout_ms": "soon"},
                                       {"buffer_bytes": 1}, {"no_such_setting": 1}, {"debug": "chatty"}])
def test_invalid_config_overrides(overrides):
    with pytest.raises(kccl.KcclInvalidArgument):
        kccl.Communicator(1, kccl.get_unique_id(), 0, config=overrides)


def test_overrides_beat_env(monkeypatch):
    monkeypatch.setenv("KCCL_TIMEOUT_MS", "bogus")
    # the bad env value is not even looked at when an override names the setting
    with kccl.Communicator(1, kccl.get_unique_id(), 0, config={"timeout_ms": 1000}) as c:
        c.barrier()
    got = kconfig.resolve({"KCCL_TIMEOUT_MS": 5}, environ={"KCCL_TIMEOUT_MS": "7", "KCCL_ALGO": "twoshot"})
    assert got["KCCL_TIMEOUT_MS"] == (5, "override") and got["KCCL_ALGO"] == ("twoshot", "env")


def test_empty_env_value_means_default(monkeypatch):
    monkeypatch.setenv("KCCL_ALGO", "")
    monkeypatch.setenv("KCCL_TIMEOUT_MS", "")
    with kccl.Communicator(1, kccl.get_unique_id(), 0) as c:
        c.barrier()
    ((rc, fields, _e),) = c_config([{"KCCL_ALGO": "", "KCCL_TIMEOUT_MS": ""}])
    assert rc == 0 and fields["timeout_ms"] == 30000 and fields["algo"] == 0


# Values both parsers must agree on (accept with the same value, or both refuse).
AGREE = [("KCCL_TIMEOUT_MS", v) for v in ("0", "1", "250", "86400000")] + \
        [("KCCL_ALGO", v) for v in ("auto", "oneshot", "twoshot", "TwoShot", "ONESHOT")] + \
        [("KCCL_ONESHOT_MAX_BYTES", v) for v in ("0", "4096", "64k", "2K", "1M")] + \
        [("KCCL_BUFFER_BYTES", v) for v in ("4096", "4k", "1M", "16m", "4095")] + \
        [("KCCL_CHUNK_BYTES", v) for v in ("4096", "256k", "1M", "4000", "100")] + \
        [("KCCL_SPIN_US", v) for v in ("-1", "0", "50")] + [("KCCL_YIELD_US", v) for v in ("-1", "100")] + \
        [("KCCL_DEBUG", v) for v in ("NONE", "warn", "Info", "TRACE", "0", "3")] + \
        [("KCCL_GPU_ONESHOT_MAX_BYTES", v) for v in ("0", "64k", "1M", "-1")] + \
        [("KCCL_GPU_BUFFER_BYTES", v) for v in ("65536", "64k", "16M", "65535", "4G", "5G")] + \
        [("KCCL_GPU_PDL", v) for v in ("0", "1", "2", "yes")] + \
        [("KCCL_GPU_FLAG_REPLICAS", v) for v in ("0", "1", " 1", "2", "-1", "on")] + \
        [("KCCL_GPU_BLOCKS", v) for v in ("0", "1", "33", "132", "133", "-1", "auto")] + \
        [("KCCL_GPU_PULL", v) for v in ("-1", "0", "1", "2", "-2", "pull")] + \
        [("KCCL_GPU_LL_THREADS", v) for v in ("0", "32", "128", "256", "100", "16", "512", "2k", "-32")] + \
        [("KCCL_GPU_LL_HOPS", v) for v in ("0", "1", "2", "3", "-1", "auto")] + \
        [("KCCL_GPU_CHUNK_THREADS", v) for v in ("0", "32", "512", "768", "800", "48", "-32", "auto")]
# Values the two parsers once disagreed on (regressions).
DISAGREE = [("KCCL_ALGO", "1"), ("KCCL_TIMEOUT_MS", "10k"), ("KCCL_BUFFER_BYTES", "1M "),
            ("KCCL_TIMEOUT_MS", "1_000"), ("KCCL_BUFFER_BYTES", "1 M"), ("KCCL_DEBUG", " info ")]


def _py_parse(name, value):
    try:
        v, _src = kconfig.resolve(environ={name: value})[name]
    except kccl.KcclInvalidArgument:
        return None
    s = kconfig.BY_NAME[name]
    return NAME_MAPS[s.field][v] if s.field in NAME_MAPS else v


@pytest.mark.parametrize("name,value", AGREE + DISAGREE)
def test_c_and_python_parse_env_alike(name, value):
    ((rc, fields, err),) = c_config([{name: value}])
    c_value = fields[kconfig.BY_NAME[name].field] if rc == 0 else None
    assert c_value == _py_parse(name, value), f"{name}={value!r}: C {c_value!r} ({err!r}), Python {_py_parse(name, value)!r}"


# One rank of a communicator in its own process: waits until the wall-clock time argv[4],
# so that every rank starts init together, then prints [error class, message, seconds].
JOIN_AT = textwrap.dedent("""
    import json, sys, time
    sys.modules["ml_dtypes"] = None
    import kccl
    n, rank, uid, at = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]), float(sys.argv[4])
    time.sleep(max(0.0, at - time.time()))
    t0 = time.monotonic()
    try:
        kccl.Communicator(n, kccl.UniqueId(uid), rank).close()
        out = ["ok", ""]
    except kccl.KcclError as e:
        out = [type(e).__name__, str(e)]
    print(json.dumps(out + [time.monotonic() - t0]))
""")


def join_apart(envs):
    """Runs one rank per env (the default KCCL_TIMEOUT_MS of 30 s unless an env sets it),
    all starting init at the same moment; [(class name, message, seconds)] per rank."""
    uid = bytes(kccl.get_unique_id()).hex()
    at = time.time() + 4.0  # past every process's start-up
    procs = [subprocess.Popen([sys.executable, "-c", JOIN_AT, str(len(envs)), str(r), uid, str(at)],
                              env=clean_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, env in enumerate(envs)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr
        out.append(tuple(json.loads(stdout)))
    return out


@pytest.mark.parametrize("envs,setting", [
    ([{}, {"KCCL_BUFFER_BYTES": "64k"}], "KCCL_BUFFER_BYTES"),  # set on one rank only
    ([{"KCCL_BUFFER_BYTES": "64k"}, {}], "KCCL_BUFFER_BYTES"),
    ([{}, {"KCCL_MAX_OUTSTANDING": "2"}, {}], "KCCL_MAX_OUTSTANDING"),
    ([{"KCCL_CHUNK_BYTES": "64k"}, {}], "KCCL_CHUNK_BYTES"),
    ([{}, {"KCCL_P2P_BYTES": "64k"}], "KCCL_P2P_BYTES"),
    ([{}, {}, {"KCCL_BUFFER_BYTES": "2M"}, {"KCCL_MAX_OUTSTANDING": "3"}], "KCCL_BUFFER_BYTES"),
])
def test_unequal_settings_fail_every_rank_at_once_alike(envs, setting):
    """Ranks whose must-be-equal settings differ all refuse at init, within 2 s (not after
    the 30 s timeout), with one and the same message naming the setting and both values."""
    res = join_apart(envs)
    for rank, (kind, msg, took) in enumerate(res):
        assert kind == "KcclInvalidUsage", (rank, res)
        assert took < 2.0, f"rank {rank} took {took:.2f} s: {msg}"
    assert len({msg for _k, msg, _t in res}) == 1, res
    assert setting in res[0][1] and "rank 0 has" in res[0][1], res[0][1]


def test_equal_settings_from_env_and_default_join():
    """The check compares values, not where they came from: 1M set on one rank equals the default."""
    res = join_apart([{}, {"KCCL_BUFFER_BYTES": "1M", "KCCL_MAX_OUTSTANDING": "1"}])
    assert [k for k, _m, _t in res] == ["ok", "ok"], res


def test_buffer_bytes_must_match_across_ranks():
    """The same through Python overrides, two ranks in one process."""
    uid = kccl.get_unique_id()
    errs = {}

    def join(rank, bb):
        try:
            kccl.Communicator(2, uid, rank, config={"buffer_bytes": bb}).close()
            errs[rank] = None
        except kccl.KcclError as e:
            errs[rank] = e

    t = threading.Thread(target=join, args=(0, 1 << 20))
    t.start()
    join(1, 64 << 10)
    t.join()
    assert all(isinstance(e, kccl.KcclInvalidUsage) for e in errs.values()), errs
    assert str(errs[0]) == str(errs[1]) and "KCCL_BUFFER_BYTES" in str(errs[0]), errs


def test_ranks_with_different_algorithms_get_a_mismatch_not_a_timeout():
    """KCCL_ALGO differing across ranks (one-shot here, two-shot there) is a collective
    mismatch at the first step, reported on both ranks well before the timeout."""
    uid = kccl.get_unique_id()
    comms, errs = {}, {}
    timeout_ms = 8000

    def join(rank, algo):
        comms[rank] = kccl.Communicator(2, uid, rank, config={"algo": algo, "timeout_ms": timeout_ms})

    def call(rank):
        x = np.arange(1000, dtype=np.float32)
        t0 = time.monotonic()
        try:
            comms[rank].all_reduce(x)
            errs[rank] = (None, time.monotonic() - t0)
        except kccl.KcclError as e:
            errs[rank] = (e, time.monotonic() - t0)

    t = threading.Thread(target=join, args=(0, "oneshot"))
    t.start()
    join(1, "twoshot")
    t.join()
    try:
        t = threading.Thread(target=call, args=(0,))
        t.start()
        call(1)
        t.join()
    finally:
        for c in comms.values():
            c.close()
    for rank, (e, took) in errs.items():
        assert isinstance(e, kccl.KcclRemoteError), f"rank {rank}: {e!r}"
        assert "mismatch" in str(e) and "all_reduce_twoshot" in str(e), str(e)
        assert took < timeout_ms / 1000 / 4, f"rank {rank} took {took:.2f} s"


# -- unknown KCCL_* variables: warned about once, with the closest known name ---------------------

WARN_PROBE = textwrap.dedent("""
    import json, sys, warnings
    sys.modules["ml_dtypes"] = None
    import kccl
    from kccl._native import ffi, lib
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(2):
            kccl.Communicator(1, kccl.get_unique_id(), 0).close()
        cfg = ffi.new("kcclConfig_t *")
        lib.kcclConfigInit(cfg)  # C programs get the same warning from their first kcclConfigInit
        lib.kcclConfigInit(cfg)
    print(json.dumps([[w.category.__name__, str(w.message)] for w in got]))
""")


def _warnings_of(**env):
    p = run_py(WARN_PROBE, clean_env(**env))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr.splitlines()


def test_misspelled_setting_is_warned_about_in_one_line_per_process():
    py, err = _warnings_of(KCCL_TIMOUT_MS="500", KCCL_BUFER_BYTES="64k", KCCL_ZZZ="1", KCCL_TIMEOUT_MS="20000")
    assert py == [], py  # no Python warning, so no echo of a source line
    (line,) = err  # stderr holds the one line and nothing else, however many inits ran
    assert line.startswith("[kccl pid ") and " WARN " in line, line
    assert "KCCL_TIMOUT_MS (did you mean KCCL_TIMEOUT_MS?)" in line, line
    assert "KCCL_BUFER_BYTES (did you mean KCCL_BUFFER_BYTES?)" in line, line
    assert re.search(r"KCCL_ZZZ[,:]", line) and "KCCL_TIMEOUT_MS," not in line, line
    assert line.endswith("not KCCL settings, ignored (python -m kccl.config lists the settings)"), line
    _py, (one,) = _warnings_of(KCCL_TIMOUT_MS="500")
    assert "KCCL_TIMOUT_MS (did you mean KCCL_TIMEOUT_MS?): not a KCCL setting, ignored" in one, one


@pytest.mark.parametrize("launcher,rank,lines", [("PMI_RANK", "0", 1), ("PMI_RANK", "1", 0),
                                                 ("OMPI_COMM_WORLD_RANK", "3", 0), ("SLURM_PROCID", "0", 1),
                                                 ("RANK", "2", 0)])
def test_misspelled_setting_is_warned_about_by_rank_0_only(launcher, rank, lines):
    _py, err = _warnings_of(KCCL_TIMOUT_MS="500", **{launcher: rank})
    assert len(err) == lines, err


def test_every_known_setting_is_known_to_c_and_python():
    valid = {s.name: str(s.default) for s in kconfig.SETTINGS if s.name != "KCCL_TOPO_FILE"}
    valid.update({b[0]: b[1] for b in kconfig.BUILD_SETTINGS})
    valid.update({s.name: str(s.default) for s in kconfig.NCCL_SETTINGS if s.name != "KCCL_NCCL_LIB"})
    py, err = _warnings_of(**valid)
    assert py == [] and err == [], (py, err)
    assert set(kconfig.KNOWN_NAMES) == set(valid) | {"KCCL_TOPO_FILE", "KCCL_NCCL_LIB"}
    assert kconfig.warn_unknown({**valid, "KCCL_ZZZ": "1", "OTHER": "1"}) == ["KCCL_ZZZ"]


@pytest.mark.parametrize("name,near", [("KCCL_TIMOUT_MS", "KCCL_TIMEOUT_MS"), ("KCCL_TIMEOUT", "KCCL_TIMEOUT_MS"),
                                       ("KCCL_ALG", "KCCL_ALGO"), ("KCCL_GPU_BLOCK", "KCCL_GPU_BLOCKS"),
                                       ("KCCL_FOO", None), ("KCCL_X", None)])
def test_closest_setting(name, near):
    assert kconfig.closest_setting(name) == near


# -- the one table: kccl_native/include/kccl_settings.def --------------------------------------------

def test_registry_comes_from_the_table():
    with open(kconfig._table_path()) as f:
        entries = kconfig.parse_table(f.read())
    names = [args[1] if macro != "KCCL_BUILD_SETTING" else args[0] for macro, args in entries]
    assert names == list(kconfig.KNOWN_NAMES)
    # the copy installed beside the library is the source tree's table, where both exist
    here = os.path.dirname(os.path.abspath(kconfig.__file__))
    copies = [os.path.join(here, "include", "kccl_settings.def"),
              os.path.join(os.path.dirname(here), "kccl_native", "include", "kccl_settings.def")]
    texts = {open(p).read() for p in copies if os.path.exists(p)}
    assert len(texts) == 1


def test_table_equal_rule_matches_the_docs():
    for s in kconfig.SETTINGS:
        assert s.equal in ("KCCL_EQUAL_NO", "KCCL_EQUAL_ALL", "KCCL_EQUAL_GPU"), s
        assert ("Must be equal on all ranks" in " ".join(s.doc.split())) == (s.equal != "KCCL_EQUAL_NO"), s.name
    assert {s.name for s in kconfig.SETTINGS if s.equal == "KCCL_EQUAL_ALL"} == \
        {"KCCL_BUFFER_BYTES", "KCCL_CHUNK_BYTES", "KCCL_MAX_OUTSTANDING", "KCCL_P2P_BYTES"}


def test_table_parser_reads_c_literals():
    text = '''/* a comment, with "quotes" and KCCL_SETTING( */
    #define KCCL_SETTING(a, ...)
    KCCL_SETTING(x, "KCCL_X", KCCL_KIND_SIZE, 16 * 1024, 0, 1L << 40, 32, KCCL_EQUAL_GPU, "", "one, " "two (three)")
    // KCCL_SETTING(y, ...) in a line comment
    KCCL_BUILD_SETTING("KCCL_B", "auto", "b")'''
    (m1, a1), (m2, a2) = kconfig.parse_table(text)
    assert m1 == "KCCL_SETTING" and a1 == ["x", "KCCL_X", "KCCL_KIND_SIZE", "16 * 1024", "0", "1L << 40", "32",
                                           "KCCL_EQUAL_GPU", "", "one, two (three)"]
    assert [kconfig._number(v) for v in a1[3:7]] == [16384, 0, 1 << 40, 32]
    assert (m2, a2) == ("KCCL_BUILD_SETTING", ["KCCL_B", "auto", "b"])


def _c_init_with(field, value):
    """kcclCommInitRankConfig of one rank with config.field = value (rc, error text)."""
    from kccl._native import ffi, lib
    cfg = ffi.new("kcclConfig_t *")
    assert lib.kcclConfigInit(cfg) == 0
    setattr(cfg, field, value)
    uid = ffi.new("kcclUniqueId *")
    assert lib.kcclGetUniqueId(uid) == 0
    comm = ffi.new("kcclComm_t *")
    rc = lib.kcclCommInitRankConfig(comm, 1, uid[0], 0, cfg)
    if rc == 0:
        lib.kcclCommDestroy(comm[0])
    return rc, ffi.string(lib.kcclGetLastError(ffi.NULL)).decode()


@pytest.mark.parametrize("setting", [s for s in kconfig.SETTINGS if s.native and s.field not in NAME_MAPS],
                         ids=lambda s: s.name)
def test_c_refuses_a_config_outside_the_table_range(setting):
    """kcclCommInitRankConfig checks a caller's kcclConfig_t against the table's ranges,
    naming the field and its variable."""
    from kccl._native import ffi
    size_field = dict(ffi.typeof("kcclConfig_t").fields)[setting.field].type.cname == "size_t"
    # a value just past the range: below it where the type can hold one, else far above it
    bad = None
    for v in (-2, -1, 0, 1, 31):
        try:
            setting.parse(str(v))
        except ValueError:
            if not (size_field and v < 0):
                bad = v
                break
    if bad is None:
        bad = 1 << 41
    rc, err = _c_init_with(setting.field, bad)
    assert rc == 4 and setting.field in err and setting.name in err, (bad, rc, err)
