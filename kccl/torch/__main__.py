"""python -m kccl.torch --build: builds the c10d backend ahead of time, into the package
when its folder is writable (where `import kccl.torch` looks first), and says where.

Importing kccl.torch (which running this module does first) finds a build or makes one
in the cache; a cache build finds libkccl.so by its absolute path and the package's by a
path relative to itself, so --build compiles the package's own rather than copying."""
import os
import sys
import time


def main(argv):
    if argv not in ([], ["--build"]):
        print("usage: python -m kccl.torch [--build]", file=sys.stderr)
        return 2
    from . import _build, _ext  # importing kccl.torch found or built it
    where = _ext.__file__
    if argv and os.path.dirname(os.path.abspath(where)) != _build.PREBUILT:
        print(f"kccl.torch: building the c10d backend into {_build.PREBUILT} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            where = _build.build_prebuilt()
            print(f"kccl.torch: built in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        except OSError as e:
            print(f"kccl.torch: cannot write {_build.PREBUILT} ({e}); the build stays in the cache",
                  file=sys.stderr)
    print(f"kccl.torch: the c10d backend is {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
