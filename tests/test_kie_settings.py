"""KIE's settings table (kie_engine/settings.py): parsing, defaults, the misspelled-name
warning, and that every KIE_* variable the engine reads is an entry."""
import glob
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from kie_engine import settings
from kie_engine.errors import GpuArgumentError, KieError, SettingError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIE_", "PMI_", "OMPI_", "PMIX_", "SLURM_"))
           and k != "RANK"}
    env.update(extra)
    return env


@pytest.mark.parametrize("name,text,want", [
    ("KIE_GPU_PREFETCH", " 1 ", 1), ("KIE_GPU_GEMV_U", "4", 4), ("KIE_GPU_MONO_PREFETCH", "-1", -1),
    ("KIE_GPU_KERNEL", "Mono", "mono"), ("KIE_GPU_PDL", "0", 0), ("KIE_BLAS_THREADS", "3", 3),
    ("KIE_CPU_HIDE", "avx2", "avx2"), ("KIE_CPU_HIDE", " AVX2 , avx512,", "avx512,avx2"),
    ("KIE_CPU_HIDE", ",", ""), ("KIE_GPU_PREFILL_ATTN", "1", 1), ("KIE_GPU_PREFILL_ATTN", "3", 3),
    ("KIE_GPU_DECODE_ATTN", "1", 1), ("KIE_GPU_ATT_KEYS", "40", 40), ("KIE_GPU_ATT_HEADS", "1", 1), ("KIE_GPU_PREFILL_F32_SUMS", "1", 1),
    ("KIE_GPU_ATT_SPLITS", "2", 2),
    ("KIE_GPU_GEMV_X_L1", "1", 1), ("KIE_GPU_L2_EVICT_FIRST", "-1", -1), ("KIE_GPU_L2_EVICT_FIRST", "0", 0),
    ("KIE_GPU_PREFILL_ATTN_KEYS", "64", 64), ("KIE_GPU_MONO_WAIT_MS", "400000", 400000)])
def test_good_values(name, text, want):
    assert settings.value(name, {name: text}) == want


@pytest.mark.parametrize("name,text,error", [
    ("KIE_GPU_PREFETCH", "3", GpuArgumentError), ("KIE_GPU_GEMV_U", "5", GpuArgumentError),
    ("KIE_GPU_MONO_BLOCKS", "-1", GpuArgumentError), ("KIE_GPU_KERNEL", "fast", GpuArgumentError),
    ("KIE_GPU_PDL", "yes", GpuArgumentError), ("KIE_GPU_ATT_CHUNK", "1.5", GpuArgumentError),
    ("KIE_GPU_PREFILL_ATTN", "4", GpuArgumentError),
    ("KIE_GPU_DECODE_ATTN", "3", GpuArgumentError), ("KIE_GPU_ATT_KEYS", "257", GpuArgumentError),
    ("KIE_GPU_ATT_HEADS", "3", GpuArgumentError), ("KIE_GPU_L2_EVICT_FIRST", "2", GpuArgumentError),
    ("KIE_GPU_L2_EVICT_FIRST", "-2", GpuArgumentError),
    ("KIE_GPU_PREFILL_ATTN_KEYS", "65", GpuArgumentError), ("KIE_GPU_MONO_WAIT_MS", "-1", GpuArgumentError),
    ("KIE_BLAS_THREADS", "0", SettingError), ("KIE_BLAS_THREADS", "two", SettingError),
    ("KIE_CPU_HIDE", "sse4", SettingError), ("KIE_CPU_HIDE", "avx2 avx512", SettingError)])
def test_bad_values_are_refused_naming_the_variable(name, text, error):
    with pytest.raises(error, match=name) as ei:
        settings.value(name, {name: text})
    assert isinstance(ei.value, (KieError, ValueError)) and repr(text) in str(ei.value)


@given(st.text(max_size=12))
def test_any_text_parses_or_is_refused_cleanly(text):
    for s in settings.SETTINGS:
        try:
            v = settings.parse(s, text)
        except (SettingError, GpuArgumentError) as e:
            assert s.name in str(e)
            continue
        if s.kind == "choice":
            assert v in s.values
        elif s.kind == "names":
            assert set(v.split(",")) - {""} <= set(s.values)
        elif s.values:
            assert v in s.values
        elif s.kind == "count":
            assert v >= 1
        else:
            assert s.lo <= v <= s.hi


def test_defaults_and_run_time_defaults():
    assert settings.value("KIE_GPU_KERNEL", {}) == "graph"
    assert settings.value("KIE_GPU_PDL", {"KIE_GPU_PDL": " "}, default=0) == 0  # blank: the run-time choice
    assert settings.value("KIE_BLAS_THREADS", {}) is None
    for s in settings.SETTINGS:
        assert s.default is None or s.kind == "choice" or settings.parse(s, str(s.default)) == s.default, s.name


def test_every_kie_variable_the_code_names_is_in_the_table():
    named = set()
    for path in glob.glob(os.path.join(ROOT, "kie_engine", "**", "*.py"), recursive=True):
        text = open(path).read()
        named |= set(re.findall(r"[\"'](KIE_[A-Z0-9_]+)[\"']", text))
        # names built from a prefix ("KIE_GPU_" + field.upper()) are checked where they reach C
        assert not re.search(r"[\"']KIE_[A-Z0-9_]*_[\"']\s*\+", text) or path.endswith(os.path.join("gpu", "engine.py")), path
    named.discard("KIE_GPU_")
    for path in glob.glob(os.path.join(ROOT, "kie_engine", "**", "*.[ch]"), recursive=True) + \
            glob.glob(os.path.join(ROOT, "kie_engine", "**", "*.cu"), recursive=True):  # C that reads one itself
        named |= set(re.findall(r"getenv\(\s*\"(KIE_[A-Z0-9_]+)\"", open(path).read()))
    assert "KIE_CPU_HIDE" in named
    assert named <= set(settings.BY_NAME), named - set(settings.BY_NAME)


WARN = "from kie_engine import settings; settings.value('KIE_GPU_PDL'); settings.value('KIE_GPU_PREFETCH')"


def _stderr(**env):
    p = subprocess.run([sys.executable, "-c", WARN], env=clean_env(**env), capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return p.stderr.splitlines()


def test_a_misspelled_name_is_warned_about_in_one_line():
    (line,) = _stderr(KIE_GPU_GEMV_UU="4", KIE_ZZZ="1")
    assert line.startswith("[kie pid ") and " WARN " in line, line
    assert "KIE_GPU_GEMV_UU (did you mean KIE_GPU_GEMV_U?), KIE_ZZZ: not KIE settings, ignored" in line, line
    assert _stderr(KIE_GPU_GEMV_U="4") == []


@pytest.mark.parametrize("var,rank,lines", [("PMI_RANK", "0", 1), ("PMI_RANK", "1", 0), ("SLURM_PROCID", "2", 0)])
def test_the_warning_comes_from_rank_0_of_a_job(var, rank, lines):
    assert len(_stderr(KIE_GPU_PDLL="1", **{var: rank})) == lines


def test_python_m_kie_engine_settings_lists_them():
    p = subprocess.run([sys.executable, "-m", "kie_engine.settings"], env=clean_env(KIE_GPU_PREFETCH="1"),
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    for s in settings.SETTINGS:
        assert any(ln.startswith(s.name + " ") for ln in p.stdout.splitlines()), s.name
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("KIE_GPU_PREFETCH ")]
    assert " 1 " in line and " env " in line
    p = subprocess.run([sys.executable, "-m", "kie_engine.settings"], env=clean_env(KIE_GPU_KERNEL="x"),
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "KIE_GPU_KERNEL" in p.stderr
