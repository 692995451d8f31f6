"""python -m kccl.torch --build: builds the c10d backend ahead of time, into the package
when its folder is writable (where `import kccl.torch` looks first), and says where."""
import os
import shutil
import sys


def main(argv):
    if argv not in ([], ["--build"]):
        print("usage: python -m kccl.torch [--build]", file=sys.stderr)
        return 2
    from . import _build, _ext  # importing kccl.torch found or built it
    where = _ext.__file__
    if argv and os.path.dirname(os.path.abspath(where)) != _build.PREBUILT:
        try:
            os.makedirs(_build.PREBUILT, exist_ok=True)
            dest = os.path.join(_build.PREBUILT, os.path.basename(where))
            shutil.copy2(where, dest + ".tmp")
            os.replace(dest + ".tmp", dest)
            where = dest
        except OSError as e:
            print(f"kccl.torch: cannot write {_build.PREBUILT} ({e}); the build stays in the cache",
                  file=sys.stderr)
    print(f"kccl.torch: the c10d backend is {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
