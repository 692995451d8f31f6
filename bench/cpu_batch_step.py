"""The native CPU engine's batch step alone, in one process: N sequences decoding
together (one row each per step, kie_cpu_batch) against one, the aggregate tokens/s per
batch size, rounds alternating the sizes; min / median / max over the rounds.  Then,
once per size, the engine's per-stage profile of the step.  What the server's
continuous batching can gain at most, with no HTTP side sharing the cores.

    python bench/cpu_batch_step.py --sizes 1,2,3,4 --rounds 4 --out bench/results/cpu_batch_step_attention_prefetch_ab.json
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="a GGUF file or short name (default smollm2: Q4_1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=40, help="steps timed per round and size")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--position", type=int, default=64, help="tokens in each sequence's cache before the steps")
    p.add_argument("--out", help="write the JSON here")
    a = p.parse_args(argv)
    from kie_engine.cpu.engine import CpuModel
    from kie_engine.formats.sources import open_checkpoint, resolve
    sizes = [int(n) for n in a.sizes.split(",")]
    m = CpuModel(open_checkpoint(resolve(a.model)), max_seq=8, threads=a.threads)
    prompt = np.random.default_rng(0).integers(100, 40000, a.position)
    tok = np.full(max(sizes), 42, np.int32)

    def steps(n, k, profile=False):
        """k steps of n fresh sequences, each after the same prompt (the same positions);
        with profile, the engine's stage times of those k steps"""
        seqs = [m.new_sequence(a.position + k + 4) for _ in range(n)]
        try:
            for s in seqs:
                m.prefill_sequence(s, prompt)
            ids = np.asarray(seqs, np.int32)
            m.run_rows(ids, tok[:n])
            m.set_profiling(profile)
            t = time.perf_counter()
            for _ in range(k):
                m.run_rows(ids, tok[:n])
            return time.perf_counter() - t
        finally:
            for s in seqs:
                m.free_sequence(s)

    agg = {n: [] for n in sizes}
    for r in range(a.rounds):  # the sizes in turn, their order reversed every other round
        for n in (sizes if r % 2 == 0 else sizes[::-1]):
            dt = steps(n, a.steps)
            agg[n].append(n * a.steps / dt)
            print(f"round {r}: {n} sequences: {agg[n][-1]:.0f} tokens/s ({1e3 * dt / a.steps:.2f} ms per step)",
                  flush=True)
    prof = {}
    for n in sizes:
        steps(n, a.steps, profile=True)
        prof[n] = {k: v * 1e3 for k, v in m.profile().items() if k != "steps"}
        m.set_profiling(False)
    one = agg[sizes[0]]
    report = {"model": a.model, "threads": a.threads, "position": a.position, "steps": a.steps, "rounds": a.rounds,
              "kernels": m.info()["kernels"], "tokens_per_s": {}, "over_first_size": {}, "stage_ms_per_step": prof,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    for n in sizes:
        xs = agg[n]
        report["tokens_per_s"][n] = {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "all": xs}
        rt = [x / o for x, o in zip(xs, one)]
        report["over_first_size"][n] = {"min": min(rt), "median": statistics.median(rt), "max": max(rt)}
        st = report["tokens_per_s"][n]
        print(f"{n} sequences: {st['min']:.0f} / {st['median']:.0f} / {st['max']:.0f} tokens/s aggregate, "
              f"{report['over_first_size'][n]['median']:.2f}x {sizes[0]}; stages (ms per step): "
              + ", ".join(f"{k} {v:.2f}" for k, v in prof[n].items()))
    m.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
