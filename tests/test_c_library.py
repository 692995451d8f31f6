"""libkccl.so, the one copy of KCCL's core in a process: it exports the API of kccl.h
and nothing else, Python's module, KIE's engines and the torch backend link it, and
docs/kccl.md's example builds against it through pkg-config and through CMake, and runs."""
import os
import re
import shutil
import subprocess

import pytest

from kccl import paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "c")
LIB = os.path.join(paths.LIB, "libkccl.so")


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCCL_")}
    env["KCCL_TIMEOUT_MS"] = "20000"
    return env


def _run_example(exe, nranks):
    res = subprocess.run([exe, str(nranks)], capture_output=True, text=True, timeout=60, env=_env())
    assert res.returncode == 0, res.stdout + res.stderr
    want = f"sum over {nranks} ranks: {nranks} {2 * nranks} {3 * nranks} {nranks * (nranks - 1) // 2}"
    assert want in res.stdout


def test_library_exports_only_the_api():
    if shutil.which("nm") is None:
        pytest.skip("nm not found")
    out = subprocess.run(["nm", "-D", "--defined-only", LIB], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert "kcclAllReduce" in names and "kcclCommInitRank" in names and "kcclGetErrorString" in names
    stray = [n for n in names if not (n.startswith("kccl") and n[4:5].isupper())]
    assert not stray, stray
    # Benchmarks and self-tests live in bench/native, not in the library or its Python copy.
    from kccl._native import lib
    header = open(os.path.join(paths.INCLUDE, "kccl.h")).read()
    for text in (" ".join(names), " ".join(dir(lib)), header):
        assert "kcclBench" not in text and "SelfTest" not in text


def _defined_api(path):
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return [n for n in (line.split()[-1] for line in out.splitlines() if line.strip()) if re.match(r"kccl[A-Z]", n)]


def test_one_copy_of_kccl_per_process():
    """The C core is compiled once, into libkccl.so: the Python package's cffi module, KIE's
    engines and (where torch is installed) the torch backend define no kccl.h function of
    their own (they link the library), and a process that loads them all maps one
    libkccl.so, the package's."""
    if shutil.which("nm") is None:
        pytest.skip("nm not found")
    import kccl._kccl_cffi
    from kie_engine.cpu import _kie_cpu_cffi
    from kie_engine.gpu import _kie_gpu_cffi
    files = [mod.__file__ for mod in (kccl._kccl_cffi, _kie_cpu_cffi, _kie_gpu_cffi)]
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        import kccl.torch
        files.append(kccl.torch._ext.__file__)
    for f in files:
        assert not _defined_api(f), f
    assert _defined_api(LIB)
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if line.rstrip().endswith("/libkccl.so")}
    assert mapped == {os.path.realpath(LIB)}, mapped


def test_example_builds_with_pkg_config(tmp_path):
    if shutil.which("pkg-config") is None or shutil.which("cc") is None:
        pytest.skip("pkg-config or cc not found")
    env = dict(os.environ, PKG_CONFIG_PATH=paths.PKGCONFIG)
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "kccl"], capture_output=True, text=True, env=env,
                           check=True).stdout.split()
    exe = str(tmp_path / "allreduce")
    subprocess.run(["cc", "-Wall", "-Werror", os.path.join(EXAMPLE, "allreduce.c"), *flags, "-o", exe], check=True)
    _run_example(exe, 3)


def test_example_builds_with_cmake(tmp_path):
    if shutil.which("cmake") is None or shutil.which("cc") is None:
        pytest.skip("cmake or cc not found")
    build = str(tmp_path / "build")
    subprocess.run(["cmake", f"-DCMAKE_PREFIX_PATH={paths.CMAKE}", "-S", EXAMPLE, "-B", build], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", build], check=True, capture_output=True)
    _run_example(os.path.join(build, "allreduce"), 2)


def test_paths_cli():
    import sys
    res = subprocess.run([sys.executable, "-m", "kccl.paths", "--pkgconfig"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == paths.PKGCONFIG
    res = subprocess.run([sys.executable, "-m", "kccl.paths", "--bogus"], capture_output=True, text=True)
    assert res.returncode == 2 and "usage" in res.stderr


def test_paths_says_when_the_library_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(paths, "LIB", str(tmp_path))
    assert paths.main([]) == 2
    assert "libkccl.so is missing" in capsys.readouterr().err
