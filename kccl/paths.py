"""Where libkccl.so and its files are, for C and C++ builds:

    python -m kccl.paths            # prefix, include and lib directories, pkg-config and CMake lines
    PKG_CONFIG_PATH=$(python -m kccl.paths --pkgconfig) pkg-config --cflags --libs kccl
    cmake -DCMAKE_PREFIX_PATH=$(python -m kccl.paths --cmake) ..
    LD_PRELOAD=$(python -m kccl.paths --nccl-shim) python train.py   # NCCL's interface, forwarded
"""
import os
import sys

PREFIX = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(PREFIX, "include")
LIB = os.path.join(PREFIX, "lib")
PKGCONFIG = os.path.join(LIB, "pkgconfig")
CMAKE = os.path.join(LIB, "cmake")
NCCL_SHIM = os.path.join(LIB, "libkccl_nccl.so")


def main(argv):
    if not os.path.exists(os.path.join(LIB, "libkccl.so")):
        print(f"error: {LIB}/libkccl.so is missing: reinstall the package (pip install -e .)", file=sys.stderr)
        return 2
    if argv == ["--pkgconfig"]:
        print(PKGCONFIG)
    elif argv == ["--cmake"]:
        print(CMAKE)
    elif argv == ["--nccl-shim"]:
        print(NCCL_SHIM)
    elif not argv:
        print(f"prefix   {PREFIX}\ninclude  {INCLUDE}\nlib      {LIB}\n"
              f"pkg-config: PKG_CONFIG_PATH={PKGCONFIG} pkg-config --cflags --libs kccl\n"
              f"CMake:      cmake -DCMAKE_PREFIX_PATH={CMAKE} ...   (find_package(kccl); target kccl::kccl)\n"
              f"NCCL shim:  LD_PRELOAD={NCCL_SHIM}   (or VLLM_NCCL_SO_PATH / SGLANG_NCCL_SO_PATH)")
    else:
        print("usage: python -m kccl.paths [--pkgconfig | --cmake | --nccl-shim]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
