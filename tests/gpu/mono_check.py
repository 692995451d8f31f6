"""The monokernel against the graph path (run on a GPU machine):

    python tests/gpu/mono_check.py [--presets tiny,small,2b] [--steps 128] [--attentions items,...] [--json FILE]
    mpiexec -n 2 python tests/gpu/mono_check.py ...     # TP = 2: a GPU per lane, or both on one GPU under MPS

The monokernel computes every op with the graph path's arithmetic in the same order (its
attention as the graph path's with the same settings: ATTENTIONS below), and at TP = 2
sums the lanes with the same KCCL one-shot (in its kernel instead of on the stream), so
the two must agree to the bit, not within a bound.  For each preset and DTP delay 0 and 1
(tiny and small: random checkpoints on disk; 2b: random bf16 weights drawn on the GPU, as
bench/decode_gpu.py does), with the split items and with the shared-memory attention (and
at delay 0 with fewer keys a block, the first preset's chunk walk, and the last preset with
the ring's copies under L2's evict_first policy):
  logits    the prompt's logits and --steps teacher-forced steps (min 48): identical arrays
  greedy    --steps greedy tokens through the captured step and through direct
            launches: identical to the graph path's (and, at TP = 2, on both lanes)
  sampling  a seeded top-k / top-p draw: identical tokens
  repeat    a second generation after a reset (the counters carried over): identical
  shape     (TP = 2) the grid: every SM alone on a GPU, (SMs - 4) / 2 with two lanes on
            one; the reducer blocks: one per 512 floats of the hidden size
Also: a bad kernel name, attention mode (mono_attn) and wait bound (mono_wait_ms) are typed
errors.  Rank 0 prints one line per check (and every rank its failures) and `MONO CHECK
(tp=N): n passed, m failed`; exit 1 on any failure."""
import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from kie_engine.formats.checkpoint import Checkpoint  # noqa: E402
from kie_engine.formats.config import preset  # noqa: E402
from kie_engine.generate import Sampling  # noqa: E402
from kie_engine.gpu.engine import GpuArgumentError, GpuModel  # noqa: E402
from kie_engine.formats.init import write_checkpoint  # noqa: E402
from kie_engine.lanes.plan import comm_config  # noqa: E402

try:
    from mpi4py import MPI
    WORLD = MPI.COMM_WORLD
    RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
except ImportError:
    WORLD, RANK, SIZE = None, 0, 1

RESULTS = []


def record(name, ok, **info):
    RESULTS.append(dict(name=name, ok=bool(ok), rank=RANK, **info))
    if RANK == 0 or not ok:
        extra = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
        print(f"{'ok  ' if ok else 'FAIL'} {name}{f' [rank {RANK}]' if SIZE > 1 else ''} {extra}", flush=True)


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


# The attentions compared: the monokernel's split items against the graph path's
# KIE_GPU_DECODE_ATTN=1; its shared-memory items (KIE_GPU_MONO_ATTN=2) by default against
# the graph path's default (the same keys a block, split keys and query heads a block; the
# splits agree up to the monokernel's cap, a block per KV head: far past these contexts);
# with 64 keys a block (splits and their combine past 64 keys) and at most 8 splits; and
# "walk": 16 keys a block and 2 splits, so that the splits walk their keys in chunks; and "l2first":
# the default with the monokernel's ring copies under L2's evict_first policy too (a cache hint,
# which must not change a bit); "slots2": its weight ring cut to two slots (each slot's mbarrier
# phases turn over more often); "fence": the stages' counts published after a full fence and polled
# with acquire loads (kie_shape.mono_sync 1; the default is release reductions and relaxed polls);
# "behind": each stage's table entry loaded as the stage starts (kie_shape.mono_ahead 2; the default
# loads it while the stage before runs); "normsums": the graph path's normed GEMVs adding the
# sublayers' sums to the residual (kie_shape.gemv_residual 2; by default, with one lane and delay 0,
# its o and down GEMVs write the new residual, as the monokernel's o and down stages do: either way
# the same bits); "monosums": the monokernel's normed stages adding the sums (kie_shape.mono_residual 2);
# "onepass" / "chain": 64 keys a block in at most 8 splits, combined in one round trip to L2 after an
# acquire-release count, or after a fence, a count and two round trips (kie_shape.att_combine 1, 2);
# "counts": every stage of the monokernel waiting for the count of the one before (kie_shape.mono_ll
# 2); by default, with one lane and delay 0, its stages hand their outputs on as LL words instead
# (mono_ll 6, refused with two lanes: QKV to the attention where every split's keys fit one chunk,
# the attention to o, o to gate/up, down to the next QKV; gate/up's count to down), which "walk"'s
# attention refuses for QKV to the attention; checked here explicitly with "onepass"'s attention
# ("llsplit", mono_ll 1: gate/up's words to down, not QKV's to the attention), between the GEMV
# stages only ("llgemv", mono_ll 3), everywhere but into the attention and the down stage ("lldown",
# mono_ll 4), everywhere but into the down stage ("llqkv", "llqkvsplit" with split attention:
# mono_ll 5) and everywhere but into the attention ("llone": mono_ll 1).
ATTENTIONS = {
    "items": {"decode_attn": 1, "mono_attn": 1},
    "default": {},
    "smem64": {"decode_attn": 2, "mono_attn": 2, "att_keys": 64, "att_splits": 8},
    "walk": {"decode_attn": 2, "mono_attn": 2, "att_keys": 16, "att_splits": 2},
    "l2first": {"l2_evict_first": 1},
    "slots2": {"mono_slots": 2},
    "fence": {"mono_sync": 1},
    "behind": {"mono_ahead": 2},
    "normsums": {"gemv_residual": 2},
    "monosums": {"mono_residual": 2},
    "onepass": {"decode_attn": 2, "mono_attn": 2, "att_keys": 64, "att_splits": 8, "att_combine": 1},
    "chain": {"decode_attn": 2, "mono_attn": 2, "att_keys": 64, "att_splits": 8, "att_combine": 2},
    "counts": {"mono_ll": 2},
    "llsplit": {"decode_attn": 2, "mono_attn": 2, "att_keys": 64, "att_splits": 8, "mono_ll": 1},
    "llgemv": {"mono_ll": 3},
    "lldown": {"mono_ll": 4},
    "llqkv": {"mono_ll": 5},
    "llqkvsplit": {"decode_attn": 2, "mono_attn": 2, "att_keys": 64, "att_splits": 8, "mono_ll": 5},
    "llone": {"mono_ll": 1},
}
ONE_LANE = {"llsplit", "llgemv", "lldown", "llqkv", "llqkvsplit", "llone"}


def models(cfg, path, max_seq, comm, same):
    """(graph, mono) engines of this lane with the same weights, on the same communicator,
    both with the tuning `same` (ATTENTIONS: attentions that sum in the same order)."""
    if path is not None:
        ckpt = Checkpoint(path)
        return [GpuModel(cfg, comm, max_seq=max_seq, kernel=k, tuning=same).load(ckpt) for k in ("graph", "mono")]
    import torch
    from decode_gpu import kie_engine, lane_weights  # this lane's share (decode_gpu reads the MPI rank too)
    w = lane_weights(cfg, torch.device("cuda", comm.device if comm is not None else 0))
    out = [kie_engine(cfg, w, comm, max_seq, kernel=k, tuning=same) for k in ("graph", "mono")]
    del w
    torch.cuda.empty_cache()
    return out


def trace(m, prompt, toks):
    """The prompt's logits and the teacher-forced steps' (each step through the captured step)."""
    m.reset()
    out = [m.prefill(prompt)]
    for t in toks[:-1]:
        out.append(m.decode_step(t))
    return np.stack(out)


def check(tag, cfg, path, steps, comm, same):
    t0 = time.time()
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, cfg.vocab_size, 11).tolist()
    max_seq = len(prompt) + steps + 8
    g, m = models(cfg, path, max_seq, comm, same)
    ref = g.generate(prompt, steps, Sampling())
    got = m.generate(prompt, steps, Sampling())
    info = m.info()
    d = first_diff(got.tokens, ref.tokens)
    record(f"{tag} greedy tokens (captured)", d < 0, steps=len(got.tokens), first_diff=d,
           graph_tps=ref.tokens_per_s, mono_tps=got.tokens_per_s, slots=info["mono_slots"],
           slot_kb=info["mono_slot_bytes"] // 1024, smem_kb=info["mono_smem"] // 1024,
           blocks=info["mono_blocks"], reducers=info["mono_reducers"], att_keys=info["mono_att_keys"],
           att_splits=info["mono_att_splits"])
    ll = same.get("mono_ll", 0) or (6 if SIZE == 1 and cfg.dtp_delay == 0 and same.get("mono_residual", 0) != 2
                                     else 2)
    # mono_ll_plan: every GEMV stage after one that writes its whole input, but layer 0's o, whose
    # residual rows are the embedding's; the o stages but with mono_ll 3, with the shared-memory attention
    layers = cfg.num_hidden_layers
    smem_att = same.get("mono_attn", 0) != 1
    o_words = ll != 3 and smem_att
    # with mono_ll 5 and 6 the attention too, where every split's keys fit one chunk (the graph
    # path's split keys at most the block's keys, which the splits cover)
    keys, splits = info["mono_att_keys"], info["mono_att_splits"]
    att_words = ll in (5, 6) and smem_att and info["mono_att_split_keys"] <= keys and splits * keys >= m.max_seq
    want_ll = 0 if ll == 2 else ((2 if ll in (4, 6) else 3) * layers + (layers - 1 if o_words else 0) +
                                 (layers if att_words else 0))
    record(f"{tag} stages reading LL words", info["mono_ll_stages"] == want_ll, got=info["mono_ll_stages"],
           want=want_ll, mono_ll=ll)
    if "att_keys" in same:
        ksplit = min(96, same["att_keys"])
        want = (same["att_keys"], ksplit, min(same["att_splits"], -(-m.max_seq // ksplit)))
        got_att = (info["mono_att_keys"], info["mono_att_split_keys"], info["mono_att_splits"])
        record(f"{tag} attention's keys, split keys and splits", got_att == want, got=got_att, want=want)
    if SIZE > 1:
        lanes = WORLD.allgather(got.tokens)
        record(f"{tag} greedy tokens equal on every lane", all(t == lanes[0] for t in lanes))
        check_shape(tag, cfg, info, WORLD.allgather(comm.device))
    eager = m.generate(prompt, min(steps, 32), Sampling(), use_graph=False)
    d = first_diff(eager.tokens, ref.tokens[:len(eager.tokens)])
    record(f"{tag} greedy tokens (direct launches)", d < 0, first_diff=d)
    n = min(steps, 48)
    lg, lm = trace(g, prompt, ref.tokens[:n]), trace(m, prompt, ref.tokens[:n])
    same = np.array_equal(lg, lm)
    record(f"{tag} logits identical", same, steps=n,
           max_abs_diff=float(np.max(np.abs(lg - lm))) if not same else 0.0)
    s = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=12)
    sg, sm = g.generate(prompt, steps, s), m.generate(prompt, steps, s)
    record(f"{tag} sampled tokens", sg.tokens == sm.tokens, first_diff=first_diff(sm.tokens, sg.tokens))
    again = m.generate(prompt, steps, Sampling())
    record(f"{tag} repeat after reset", again.tokens == ref.tokens, first_diff=first_diff(again.tokens, ref.tokens))
    g.close()
    m.close()
    return time.time() - t0


def check_shape(tag, cfg, info, devices):
    """The grid and the reducers the lanes' sums take (TP > 1): a block per SM, or with
    the lanes on one GPU (more ranks than GPUs, as GpuModel decides, or every lane's
    communicator on the same device, as KCCL's pull mode tells the engine) its SMs less 4
    split between them; a reducer per 512 floats of the hidden size (padded to 8)."""
    from kie_engine.gpu.engine import device_count
    shared = SIZE > device_count() or len(set(devices)) == 1
    want_blocks = (info["sms"] - 4) // SIZE if shared else info["sms"]
    want_red = (-(-cfg.hidden_size // 8) * 8 + 511) // 512
    record(f"{tag} grid and reducers", info["mono_blocks"] == want_blocks and info["mono_reducers"] == want_red,
           blocks=info["mono_blocks"], want_blocks=want_blocks, reducers=info["mono_reducers"],
           want_reducers=want_red, shared_gpu=shared, devices=devices)


def refused(label, needle, **kw):
    """GpuModel(tiny, **kw) must raise GpuArgumentError whose message holds needle."""
    try:
        GpuModel(preset("tiny"), **kw)
        record(f"error: {label}", False, raised="nothing")
    except GpuArgumentError as e:
        record(f"error: {label}", needle in str(e), raised=type(e).__name__, msg=str(e)[:80])


def check_errors():
    refused("unknown kernel", "graph", kernel="fused")
    refused("mono_attn=3", "mono_attn=3", kernel="mono", tuning={"mono_attn": 3})
    refused("mono_wait_ms=-1", "mono_wait_ms=-1", kernel="mono", tuning={"mono_wait_ms": -1})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny,small,2b")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--attentions", default=",".join(ATTENTIONS),
                    help="of ATTENTIONS, the ones to check (a sanitizer run may want one)")
    ap.add_argument("--json")
    a = ap.parse_args()
    atts = a.attentions.split(",")
    unknown = [x for x in atts if x not in ATTENTIONS]
    if unknown:
        ap.error(f"--attentions: {', '.join(unknown)}: choose of {', '.join(ATTENTIONS)}")
    comm = None
    if SIZE > 1:
        import kccl
        comm = kccl.Communicator.from_mpi(WORLD, device="local", config=comm_config(preset("tiny", dtp_delay=1)))
    with tempfile.TemporaryDirectory() as root:
        root = WORLD.bcast(root if RANK == 0 else None) if WORLD is not None else root
        presets = a.presets.split(",")
        cases = [(name, d, att) for att in ("items", "default") if att in atts for name in presets for d in (0, 1)]
        cases += [(name, 0, "smem64") for name in presets if "smem64" in atts]
        cases += [(presets[0], 0, "walk")] if "walk" in atts else []
        cases += [(presets[-1], 0, "l2first")] if "l2first" in atts else []
        cases += [(name, d, att) for att in ("slots2", "fence", "behind", "normsums", "monosums", "counts")
                  if att in atts
                  for name in presets for d in (0, 1)]
        cases += [(name, 0, att) for att in ("onepass", "chain") if att in atts for name in presets]
        cases += [(name, 0, att) for att in sorted(ONE_LANE) if att in atts and SIZE == 1 for name in presets]
        uncovered = sorted(set(atts) - {att for _, _, att in cases} - (ONE_LANE if SIZE > 1 else set()))
        if uncovered:  # an ATTENTIONS entry this list does not run would pass unchecked
            ap.error(f"--attentions: no cases for {', '.join(uncovered)}")
        for name, d, att in cases:
            cfg = preset(name, dtp_delay=d)
            tag = f"{name} d={d} tp={SIZE} {att}"
            try:
                path = None
                if name != "2b":
                    path = os.path.join(root, f"{name}_d{d}")
                    if RANK == 0 and not os.path.exists(path):
                        write_checkpoint(cfg, path, seed=7)
                    if WORLD is not None:
                        WORLD.Barrier()
                secs = check(tag, cfg, path, a.steps, comm, ATTENTIONS[att])
                if RANK == 0:
                    print(f"  ({tag}: {secs:.1f} s)", flush=True)
            except Exception as e:  # a crash is a failed check; one lane alone the others still run
                record(f"{tag} crashed", False, error=f"{type(e).__name__}: {e}")
                traceback.print_exc()
                if SIZE > 1:  # the lanes' calls no longer pair up (and the communicator is broken)
                    break
        try:
            check_errors()
        except Exception as e:
            record("errors crashed", False, error=f"{type(e).__name__}: {e}")
        if WORLD is not None:
            WORLD.Barrier()
    allres = WORLD.gather(RESULTS, root=0) if WORLD is not None else [RESULTS]
    if comm is not None:
        comm.abort() if any(not r["ok"] for r in RESULTS) else comm.close()
    if RANK != 0:
        return 0
    flat = [r for rs in allres for r in rs]
    bad = [r for r in flat if not r["ok"]]
    print(f"MONO CHECK (tp={SIZE}): {len(flat) - len(bad)} passed, {len(bad)} failed", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(flat, f, indent=1, default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
