"""Latency of one chat-template render (kie_engine/formats/chat.py), as a server pays it before
every chat request's prefill: SmolLM2's own template, a short conversation, renders of
one ChatTemplate one after another (the first one, which starts the renderer, is not
counted).  --with-torch imports torch first, as a process serving through torch would
have it loaded (a fork costs more the more the process maps).

    python bench/chat_template_render.py --label reused            # 5 rounds of 30 renders
    python bench/chat_template_render.py --label reused --with-torch

Each run merges {label: {with_torch|without_torch: min/median/max of the per-round
medians, ms}} into --out (bench/results/chat_template_render_latency.json), so that
runs of two versions of kie_engine/formats/chat.py can be put side by side in one file."""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True, help="what is measured (e.g. the commit or the approach)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--renders", type=int, default=30, help="renders per round")
    ap.add_argument("--with-torch", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "chat_template_render_latency.json"))
    a = ap.parse_args()
    if a.with_torch:
        import torch  # noqa: F401
    from kie_engine.formats.sources import open_checkpoint
    ckpt = open_checkpoint("smollm2")
    template = ckpt.chat_template()
    load = {"start": os.getloadavg()}
    template.render(MESSAGES)  # warm (starts the renderer where there is one)
    medians = []
    for r in range(a.rounds):
        times = []
        for _ in range(a.renders):
            t0 = time.perf_counter()
            template.render(MESSAGES)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times) * 1e3)
        print(f"{a.label} ({'with' if a.with_torch else 'without'} torch) round {r}: median {medians[-1]:.3f} ms, "
              f"min {min(times) * 1e3:.3f}, max {max(times) * 1e3:.3f}", flush=True)
    load["end"] = os.getloadavg()
    fig = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            fig = json.load(f)
    fig.setdefault("what", "ms per ChatTemplate.render of SmolLM2's template (system + user message); "
                           "min / median / max over rounds of each round's median")
    fig.setdefault("runs", {}).setdefault(a.label, {})["with_torch" if a.with_torch else "without_torch"] = {
        "min": min(medians), "median": statistics.median(medians), "max": max(medians), "round_medians": medians,
        "renders_per_round": a.renders, "load_average_1_5_15": load,
        "command": "python bench/chat_template_render.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(fig, f, indent=1)


if __name__ == "__main__":
    main()
