"""Captures this machine's topology sources into a directory, for fixtures and
for bug reports from machines we do not have:

    python -m topology.capture DEST            # sysfs + KFD files topology/ reads, NVML JSON if available

DEST then works as `python -m topology --root DEST [--nvml DEST/nvml.json]`."""
import glob
import json
import os
import re
import shutil
import sys

from . import nvml
from .errors import TopologyError

PATTERNS = (
    "sys/devices/system/cpu/online", "sys/devices/system/cpu/possible",
    "sys/devices/system/cpu/cpu[0-9]*/topology/physical_package_id",
    "sys/devices/system/cpu/cpu[0-9]*/topology/core_id",
    "sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list",
    "sys/devices/system/cpu/cpu[0-9]*/topology/core_cpus_list",
    "sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*/level",
    "sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*/type",
    "sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*/size",
    "sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*/shared_cpu_list",
    "sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*/id",
    "sys/devices/system/node/online", "sys/devices/system/node/node[0-9]*/cpulist",
    "sys/devices/system/node/node[0-9]*/distance",
    "sys/class/kfd/kfd/topology/nodes/*/properties", "sys/class/kfd/kfd/topology/nodes/*/gpu_id",
    "sys/class/kfd/kfd/topology/nodes/*/io_links/*/properties",
)


def capture(dest, root="/"):
    n = 0
    for pat in PATTERNS:
        for src in glob.glob(os.path.join(root, pat)):
            rel = os.path.relpath(src, root)
            out = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            try:
                shutil.copyfile(src, out)
                n += 1
            except OSError:
                pass  # unreadable attributes (permissions) are simply not captured
    with open("/proc/self/status") as f:
        m = re.search(r"^Cpus_allowed_list:.*$", f.read(), re.M)
    if m:
        os.makedirs(os.path.join(dest, "proc/self"), exist_ok=True)
        with open(os.path.join(dest, "proc/self/status"), "w") as f:
            f.write(m.group(0) + "\n")
    try:
        doc = nvml.capture()
    except TopologyError:
        doc = None
    except Exception:  # noqa: BLE001 - NVML without a driver: no NVIDIA GPUs to record
        doc = None
    if doc is not None:
        with open(os.path.join(dest, "nvml.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return n


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m topology.capture DEST", file=sys.stderr)
        return 2
    print(f"{capture(argv[0])} files captured under {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
