"""PyTorch tensor-parallel decode with and without libkccl_nccl.so, in one call.

    python bench/nccl_shim_decode.py --np 2 --json bench/results/nccl_shim_decode_2xh200.json
    MPIEXEC="mpiexec --allow-run-as-root" python bench/nccl_shim_decode.py --np 2 -- --contexts 128 --rounds 3

Runs bench/decode_gpu.py's PyTorch baseline (the `2b` Llama step in a CUDA graph, its
all-reduces through torch.distributed's NCCL backend) twice under MPI: with plain NCCL,
then with the shim preloaded, which sends the step's small all-reduces to KCCL.  Nothing
else changes between the two runs.  KIE's own rows (which call KCCL directly) come along
in both runs as a control: they should not move.  Arguments after `--` go to
decode_gpu.py (default: --baseline graph --kernels graph --delays 0)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from kccl.paths import NCCL_SHIM  # noqa: E402
from benchlib import mpi_launcher, nccl_shim_runs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("rest", nargs="*", help="arguments for bench/decode_gpu.py (after --)")
    a = ap.parse_args()
    extra = a.rest or ["--baseline", "graph", "--kernels", "graph", "--delays", "0"]
    launcher = mpi_launcher(a.np)
    script = os.path.join(ROOT, "bench", "decode_gpu.py")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, pre in nccl_shim_runs():
            out = os.path.join(tmp, name + ".json")
            cmd = launcher + pre + [sys.executable, script, *extra, "--json", out]
            print(f"# {name}: {' '.join(cmd)}", flush=True)
            p = subprocess.run(cmd, capture_output=True, text=True)
            shim_lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("kccl_nccl")]
            for ln in shim_lines:
                print(f"#   {ln}")
            if p.returncode or not os.path.exists(out):
                print(p.stdout[-3000:] + p.stderr[-3000:])
                sys.exit(f"the {name} run failed (exit {p.returncode})")
            with open(out) as f:
                results[name] = json.load(f)
            results[name]["shim_lines"] = shim_lines
    base = results["nccl"]
    rows = []
    print(f"\n# {base['meta']['gpu']} x {base['meta']['gpus']}, {base['meta']['ranks']} ranks, "
          f"preset {base['meta']['preset']}")
    print(f"{'engine':6s} {'kernel':13s} {'ctx':>5s} {'plain NCCL':>11s} {'with shim':>11s} {'speed-up':>9s}  (us/token)")
    for r in base["rows"]:
        if "variant" in r:
            continue
        twin = [s for s in results["kccl_nccl"]["rows"] if all(s.get(k) == r.get(k) for k in
                                                              ("engine", "kernel", "dtp_delay", "context"))
                and "variant" not in s]
        if not twin:
            continue
        s = twin[0]
        rows.append({"engine": r["engine"], "kernel": r["kernel"], "tp": r["tp"], "gpus": r["gpus"],
                     "dtp_delay": r["dtp_delay"], "context": r["context"], "us_per_token_nccl": r["us_per_token"],
                     "us_per_token_kccl_nccl": s["us_per_token"], "speedup": r["us_per_token"] / s["us_per_token"]})
        print(f"{r['engine']:6s} {r['kernel']:13s} {r['context']:5d} {r['us_per_token']:11.1f} "
              f"{s['us_per_token']:11.1f} {rows[-1]['speedup']:8.2f}x")
    if a.json:
        meta = dict(base["meta"], command=" ".join(sys.argv), shim=NCCL_SHIM,
                    shim_lines=results["kccl_nccl"]["shim_lines"], date=time.strftime("%Y-%m-%d %H:%M:%S"))
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "runs": {k: v["rows"] for k, v in results.items()}}, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
