"""The graph path's step clock, summed (bench/kie_bench.py's graph_profile reads the marks
off the GPU; this is its arithmetic, which needs none)."""
import numpy as np


def summarize(t, layers):
    """t: [launches][4 or 6][blocks] microseconds, each block's start, wait passed, input
    staged and end, then (a normed GEMV's) its thread 0's loads landed and its sum of squares
    done (kie_kernels.h's KIE_CLK_*; 0: the block did not mark), the launches in a step's
    order (per layer QKV, attention, o, gate/up, down; then the head).  For each kind of
    launch, microseconds summed over the layers:
      crit     the step's critical path: the launch's last block done, less the previous
               launch's (the kinds' crit add up to the step, the pick's kernel aside);
      pdl      from the previous launch's last block done to this one's first block past
               its wait (what PDL's dependency costs: the grid's completion and flush);
      after    from that first wait passed to this launch's last block done (its work once
               its input may be read);
      stage_x  per block, from its wait passed to its input staged (norm or copy of x), mean;
               the attention's: to its first chunk's scores and softmax done;
      spread   the last block's end less the first block's;
      x_loaded per block, from its wait passed to its residual and sums landed, mean (normed
               GEMVs), the attention's to its first chunk's rows and queries in shared memory;
               0 elsewhere;
      x_summed per block, from those loads landed to the block's sum of squares done, mean
               (the rest of stage_x: gamma, the scaling, the copy into shared memory); the
               attention's from its rows landed to its values done (scores, softmax, values);
      lead     how long before the previous launch's end this one's first block started
               (its early loads' head start; negative: it started after);
      landed   the share of this launch's blocks that started before the previous ended;
    and "total": the first launch's first start to the head's last end."""
    start, waited, staged, end = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    # blocks that marked in this step: those without work do not mark, and keep what they
    # marked in an earlier step (before this step's first launch, whose blocks all work)
    t0 = start[0][end[0] > 0].min() if (end[0] > 0).any() else 0.0
    has = (end > 0) & (start >= t0)
    kinds = ["qkv", "attention", "o", "gate_up", "down"] * layers + ["head"]
    loaded, summed = (t[:, 4], t[:, 5]) if t.shape[1] >= 6 else (np.zeros_like(start), np.zeros_like(start))
    keys = ("crit", "pdl", "after", "stage_x", "x_loaded", "x_summed", "spread", "lead", "landed")
    out = {k: dict.fromkeys(keys, 0.0) for k in dict.fromkeys(kinds)}
    count = dict.fromkeys(out, 0)
    prev_end = None
    for i, k in enumerate(kinds):
        h = has[i]
        if not h.any():
            prev_end = None
            continue
        last, first_wait = end[i][h].max(), waited[i][h].min()
        o = out[k]
        if prev_end is not None:
            o["crit"] += last - prev_end
            o["pdl"] += first_wait - prev_end
            o["lead"] += prev_end - start[i][h].min()
            o["landed"] += float(np.mean(start[i][h] < prev_end))
            count[k] += 1
        o["after"] += last - first_wait
        o["stage_x"] += float(np.mean(staged[i][h] - waited[i][h]))
        hn = h & (loaded[i] > 0) & (summed[i] > 0)
        if hn.any():
            o["x_loaded"] += float(np.mean(loaded[i][hn] - waited[i][hn]))
            o["x_summed"] += float(np.mean(summed[i][hn] - loaded[i][hn]))
        o["spread"] += last - end[i][h].min()
        prev_end = last
    for k in out:
        out[k]["landed"] = out[k]["landed"] / count[k] if count[k] else 0.0
    out = {k: {a: round(float(b), 2 if a == "landed" else 1) for a, b in v.items()} for k, v in out.items()}
    first = start[0][has[0]].min() if has[0].any() else None
    out["total"] = round(float(end[-1][has[-1]].max() - first), 1) if first is not None and has[-1].any() else None
    return out
