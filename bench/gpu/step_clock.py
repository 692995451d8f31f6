"""The graph path's step clock and the monokernel's stage clock, summed (bench/kie_bench.py's
graph_profile and mono_profile read the marks off the GPU; this is their arithmetic, which
needs none)."""
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


def summarize_mono(t, layers):
    """t: [stages][4][blocks] microseconds, the monokernel's marks of its last step (mono.cu's
    MARK_*: each block's start of a stage, its input staged, its end, and its producer's first
    copy of the stage; 0: the block did not mark), the stages in a step's order (per layer
    QKV, attention, o, gate/up, down; then the head).  For each kind of stage, microseconds
    summed over the layers:
      crit     the step's critical path: the stage's last block done, less the previous
               stage's (the kinds' crit add up to the step);
      wait     per block, from its previous stage's end to this stage's start (its wait
               for the stage's inputs), the mean over blocks;
      seen     per block still waiting when the previous stage's last block ended, from that
               end to its start, the mean over those blocks: how late a waiting block sees
               the stage's count reached (a poll's round trip, the barrier after it);
      stage_x  per block, staging the input (norm or copy of x), mean;
      run      per block, from the input staged to its share written (tiles waited for and
               used), mean; spread: the last block's end less the first block's;
      lead     per block, how long before the consumers started the stage the producer
               had issued the stage's first tile (negative: issued after), mean;
    for attention stages, in place of stage_x / run / lead: scores, values and rest, thread
    0's first item from its start to its scores and softmax done, to its values done, and
    on to the block's end (the combine, further items), mean over blocks with items; and
    "total": the first stage's first start to the head's last end.  For GEMV kinds also
      run_cv_block  how much the blocks' runs differ in a way that stays with the block: the
                    spread (coefficient of variation) across blocks of each block's run
                    relative to its stage's mean, averaged over the layers;
      run_cv_noise  and in a way that does not: the spread of each block's relative run
                    across the layers, the mean over blocks.  A stage whose blocks' runs
                    differ mostly by block (an SM that streams slower every layer) could take
                    shares sized to the blocks; one whose runs differ by noise could not;
      end_sd_block  likewise for when the blocks end (us after their stage's mean end): the
      end_sd_noise  spread across blocks of each one's mean over the layers, and the mean
                    over blocks of each one's spread across the layers."""
    start, staged, end, issued = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    has = end > 0  # blocks with a share of the stage (the others never mark it)
    kinds = ["qkv", "attention", "o", "gate_up", "down"] * layers + ["head"]
    keys = ("crit", "wait", "seen", "stage_x", "run", "spread", "lead")
    out = {k: dict.fromkeys(keys, 0.0) for k in dict.fromkeys(kinds)}
    prev_end_all = None
    prev_end = None
    for i, k in enumerate(kinds):
        h = has[i]
        if not h.any():
            continue
        last = end[i][h].max()
        o = out[k]
        o["crit"] += last - (prev_end_all if prev_end_all is not None else start[i][h].min())
        if prev_end is not None:
            hb = h & (prev_end > 0)
            if hb.any():
                o["wait"] += float(np.mean(start[i][hb] - prev_end[hb]))
        if prev_end_all is not None:
            late = h & (start[i] >= prev_end_all)
            if late.any():
                o["seen"] += float(np.mean(start[i][late] - prev_end_all))
        o["stage_x"] += float(np.mean(staged[i][h] - start[i][h]))
        o["run"] += float(np.mean(end[i][h] - staged[i][h]))
        o["spread"] += last - end[i][h].min()
        hi = h & (issued[i] > 0)
        if hi.any():
            o["lead"] += float(np.mean(start[i][hi] - issued[i][hi]))
        prev_end_all = last
        prev_end = np.where(h, end[i], prev_end if prev_end is not None else 0)
    # attention: thread 0's first item, split into scores + softmax, values, and the rest
    # (the combine, further items, the block's wait for its other half), over blocks with items
    att = {"scores": 0.0, "values": 0.0, "rest": 0.0}
    for i, k in enumerate(kinds):
        if k != "attention":
            continue
        hi = has[i] & (issued[i] > 0) & (staged[i] > 0)
        if hi.any():
            att["scores"] += float(np.mean(staged[i][hi] - start[i][hi]))
            att["values"] += float(np.mean(issued[i][hi] - staged[i][hi]))
            att["rest"] += float(np.mean(end[i][hi] - issued[i][hi]))
    if "attention" in out:
        out["attention"]["stage_x"] = 0.0  # its STAGED mark is the item's clock, not an input staged
        out["attention"]["run"] = out["attention"]["lead"] = 0.0
        out["attention"].update(att)
    out = {k: {a: round(float(b), 1) for a, b in v.items()} for k, v in out.items()}
    for k in ("qkv", "o", "gate_up", "down"):
        idx = [i for i, kk in enumerate(kinds) if kk == k and has[i].all()]
        if len(idx) < 2:
            continue
        run = np.stack([end[i] - staged[i] for i in idx])  # layers x blocks
        relr = run / run.mean(axis=1, keepdims=True)
        out[k]["run_cv_block"] = round(float(relr.mean(axis=0).std()), 4)
        out[k]["run_cv_noise"] = round(float(relr.std(axis=0).mean()), 4)
        late = np.stack([end[i] - end[i].mean() for i in idx])
        out[k]["end_sd_block"] = round(float(late.mean(axis=0).std()), 3)
        out[k]["end_sd_noise"] = round(float(late.std(axis=0).mean()), 3)
    first = start[0][has[0]].min()
    out["total"] = round(float(end[-1][has[-1]].max() - first), 1) if has[-1].any() else None
    return out
