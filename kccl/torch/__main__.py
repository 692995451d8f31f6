"""python -m kccl.torch --build: builds (or finds) the c10d backend and says where."""
import sys


def main(argv):
    if argv not in ([], ["--build"]):
        print("usage: python -m kccl.torch [--build]", file=sys.stderr)
        return 2
    from . import _build
    mod = _build.load()
    print(f"kccl.torch: the c10d backend is {mod.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
