"""The C API on its own: kccl.h compiles as C and as C++, and a C program that
forks its ranks (no Python, no MPI) all-reduces, all-gathers and broadcasts
correctly and gets result codes for bad arguments."""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE = os.path.join(ROOT, "kccl_native", "include")
SOURCES = sorted(glob.glob(os.path.join(ROOT, "kccl_native", "src", "*.c")))


def _need(tool):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not found")


def test_header_is_valid_c_and_cpp(tmp_path):
    _need("gcc")
    src = tmp_path / "h.c"
    src.write_text('#include "kccl.h"\nint main(void) { kcclComm_t c = 0; (void)c; return 0; }\n')
    subprocess.run(["gcc", "-std=c99", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", f"-I{INCLUDE}", str(src)],
                   check=True)
    if shutil.which("g++"):
        cpp = tmp_path / "h.cpp"
        cpp.write_text(src.read_text())
        subprocess.run(["g++", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", f"-I{INCLUDE}", str(cpp)], check=True)


@pytest.mark.parametrize("nranks", [1, 3])
def test_c_program_with_forked_ranks(tmp_path, nranks):
    _need("gcc")
    exe = tmp_path / "allreduce_fork"
    subprocess.run(["gcc", "-O2", "-std=gnu11", f"-I{INCLUDE}", os.path.join(ROOT, "tests", "c", "allreduce_fork.c"),
                    *SOURCES, "-o", str(exe), "-lrt", "-lpthread"], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCCL_")}
    env["KCCL_TIMEOUT_MS"] = "20000"
    res = subprocess.run([str(exe), str(nranks)], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"ok {nranks} ranks" in res.stdout
