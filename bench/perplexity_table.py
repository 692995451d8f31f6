"""The numerics table of docs/numerics.md: perplexity, KL divergence and top-1 agreement
against the float32 reference, on the first N tokens of a public-domain text, for each
kernel level (KIE_CPU_HIDE hides the faster ones), TP = 1, 2, 3, the numpy reference, and
each `convert --quantize` type; with llama.cpp's perplexity on the same token ids of the
same file beside them (llama-cpp-python, when installed: `pip install -e '.[bench]'`).

    python bench/perplexity_table.py [--model smollm2] [--file bench/texts/coriolanus_act1.txt]
        [--tokens 512] [--json bench/results/perplexity_smollm2_coriolanus_512.json]

Each KIE row is one `python -m kie_engine perplexity --reference --json` process (under
mpiexec for TP > 1); the quantized files are written by `convert --quantize` into a
scratch folder first.  Nothing here is timed."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def kie_row(model, text, tokens, out, lanes=1, hide="", kernel="native"):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), KIE_CPU_HIDE=hide)
    cmd = [sys.executable, "-m", "kie_engine", "perplexity", "--model", model, "--file", text, "--tokens",
           str(tokens), "--kernel", kernel, "--reference", "--json", out, "--threads", "1" if lanes > 1 else "2"]
    if lanes > 1:
        cmd = [mpiexec(), "-n", str(lanes)] + cmd
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    with open(out) as f:
        return json.load(f)


def llama_cpp_perplexity(path, ids):
    """llama.cpp's perplexity of the same token ids (all N - 1 predictions of one pass), or
    None without llama-cpp-python."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from kie_engine.perplexity import log_softmax
    llm = Llama(model_path=path, n_ctx=len(ids), n_batch=len(ids), logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    logp = log_softmax(np.asarray(llm.scores[:len(ids) - 1], np.float64))
    nll = -logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    import llama_cpp
    return float(np.exp(nll.mean())), llama_cpp.__version__


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--file", default=os.path.join(ROOT, "bench", "texts", "coriolanus_act1.txt"))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "perplexity_smollm2_coriolanus_512.json"))
    a = ap.parse_args()
    from kie_engine.cpu import kernels as K
    from kie_engine.perplexity import text_ids
    from kie_engine.formats.sources import open_checkpoint, resolve
    src = resolve(a.model)
    ids = text_ids(open_checkpoint(a.model).tokenizer(), a.file, a.tokens)
    levels = K.levels()
    hide = {"avx512": "", "avx2": "avx512", "scalar": "avx512,avx2"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        def add(what, fmt, model, **kw):
            r = kie_row(model, a.file, a.tokens, os.path.join(tmp, f"{len(rows)}.json"), **kw)
            r.update(what=what, format=fmt)
            rows.append(r)
            print(f"{what:32s} {fmt:6s} ppl {r['perplexity']:.4f} ref {r['reference_perplexity']:.4f} "
                  f"KL {r['kl_mean']:.6f} top-1 {100 * r['top1_agreement']:.2f} %", flush=True)
        for lv in ("avx512", "avx2", "scalar"):
            if lv in levels:
                add(f"native, {lv}, TP = 1", "Q4_1", src, hide=hide[lv])
        for n in (2, 3):
            add(f"native, {levels[0]}, TP = {n}", "Q4_1", src, lanes=n)
        add("numpy reference, TP = 1", "Q4_1", src, kernel="numpy")
        files = {"Q4_1": src}
        for q in ("q8_0", "q4_0", "q4_1", "q4_k"):
            out = os.path.join(tmp, f"{q}.gguf")
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            subprocess.run([sys.executable, "-m", "kie_engine", "convert", "--model", src, "--quantize", q, "--out", out],
                           env=env, check=True, capture_output=True)
            files[f"convert {q}"] = out
            add(f"native, {levels[0]}, TP = 1", f"convert --quantize {q}", out)
        llama = {}
        for name, path in files.items():
            got = llama_cpp_perplexity(path, ids)
            llama[name] = got[0] if got else None
            version = got[1] if got else None
        for r in rows:
            key = "Q4_1" if r["format"] == "Q4_1" else "convert " + r["format"].split()[-1]
            r["llama_cpp_perplexity"] = llama[key]
    meta = {"model": a.model, "file": os.path.relpath(a.file, ROOT), "tokens": a.tokens, "token_ids_sha": 
            __import__("hashlib").sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16],
            "llama_cpp": version, "levels": levels}
    with open(a.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\nwrote {a.json}\n")
    print("| engine | weights | perplexity | llama.cpp perplexity | reference perplexity | KL divergence (mean) "
          "| top-1 agreement |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        lc = f"{r['llama_cpp_perplexity']:.3f}" if r["llama_cpp_perplexity"] else "-"
        print(f"| {r['what']} | {r['format']} | {r['perplexity']:.3f} | {lc} | {r['reference_perplexity']:.3f} | "
              f"{max(0.0, r['kl_mean']):.5f} | {100 * r['top1_agreement']:.1f} % |")  # -0.0: float32 rounding


if __name__ == "__main__":
    main()
