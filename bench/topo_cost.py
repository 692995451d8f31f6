"""The cost-model tables of topology.cost for every fixture machine (no hardware needed).

    python bench/topo_cost.py [--bytes 8,1024] [--placement compact,scatter]

Builds the fixture trees in a temporary directory, discovers each machine, and prints
cross-domain cache-line transfers per one-shot all-reduce for 8 to 192 ranks: one copy
of each flag vs KCCL's per-domain replicas (and, for comparison, replicas written with
plain stores)."""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import topology  # noqa: E402
from topology import cost  # noqa: E402
from topology.fixtures import build as fixtures  # noqa: E402

RANKS = (8, 16, 24, 32, 48, 64, 96, 128, 192)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", default="8,1024")
    ap.add_argument("--placement", default="compact,scatter")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for name in fixtures.FIXTURES:
            t = topology.discover(fixtures.build(name, d), nvml_json=fixtures.nvml_json(name))
            for placement in a.placement.split(","):
                for nbytes in (int(x) for x in a.bytes.split(",")):
                    rows = cost.table(t, RANKS + ((1, 2) if name == "this-machine" else ()), nbytes, placement)
                    print(cost.format_table(f"{name} ({len(t.cpu_domains())} domains)", rows, nbytes, placement))
                    print()


if __name__ == "__main__":
    main()
