"""KIE's GPU engine against the numpy engine and transformers (run on a GPU machine):

    python tests/gpu/kie_check.py [--presets tiny,small] [--steps 64]     # TP = 1
    mpiexec -n 2 python tests/gpu/kie_check.py ...                          # TP = 2 (a GPU per rank, or one GPU under MPS)

For each preset (random weights, bf16 checkpoint) and DTP delay 0 and 1:
  logits    the prompt's last logits and every teacher-forced decode step against the
            numpy engine with a bf16 KV cache (the same function up to float32
            summation order): relative L2 error at most BOUND at every step
  greedy    the fast path (argmax on the device inside the CUDA graph, a few steps in
            flight) gives numpy's greedy tokens, --steps of them; eager launches too
  sampling  top_k=1 gives the greedy tokens; a seed gives the same tokens twice; with
            top_k=5 every token is among the 5 best of the reference logits at its step;
            top_p=1e-6 gives the greedy tokens
  prefill   the batched prefill (GEMMs) against the token-by-token one: last logits within
            PF_BOUND, the same argmax and the same greedy tokens after it, over chunk boundaries
  hf        (delay 0) logits against transformers' LlamaForCausalLM in float32 on the GPU
            within HF_BOUND (its KV cache is float32), and its greedy tokens
  errors    a token outside the vocabulary, a prompt longer than the context, a model
            larger than the GPU: typed errors, and the engine still works after them
Rank 0 prints one line per check and `KIE GPU CHECK: n passed, m failed`; exit 1 on any
failure.  --json FILE writes every check with its numbers."""
import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from kie_engine.formats.checkpoint import Checkpoint  # noqa: E402
from kie_engine.formats.config import preset  # noqa: E402
from kie_engine.errors import GpuMemoryError, KieError, PromptTooLongError  # noqa: E402
from kie_engine.generate import Sampling, generate  # noqa: E402
from kie_engine.gpu.engine import GpuArgumentError, GpuModel  # noqa: E402
from kie_engine.formats.init import write_checkpoint  # noqa: E402
from kie_engine.reference.model import Model, load_weights  # noqa: E402
from kie_engine.lanes.plan import comm_config  # noqa: E402

BOUND = 2e-3     # GPU vs numpy with the same bf16 KV rounding: float32 summation order only
HF_BOUND = 2e-2  # GPU (bf16 KV cache) vs transformers (float32 KV cache)
PF_BOUND = 3e-2  # batched prefill (bf16 activations into the GEMMs) vs token by token (f32 activations)

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
        print(f"[rank {RANK}] {'ok  ' if ok else 'FAIL'} {name} {extra}", flush=True)


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def make_checkpoints(root, configs):
    """{key: config} -> {key: path}: rank 0 writes each checkpoint, every rank waits for them."""
    paths = {}
    for key, cfg in configs.items():
        paths[key] = os.path.join(root, re.sub(r"\W+", "_", str(key)))
        if RANK == 0:
            write_checkpoint(cfg, paths[key], seed=7)
    if WORLD is not None:
        WORLD.Barrier()
    return paths


def guarded(tag, check, *args):
    """check(*args); a crash is a failed check, and the others still run."""
    try:
        return check(*args)
    except Exception as e:
        record(f"{tag} crashed", False, error=f"{type(e).__name__}: {e}")
        traceback.print_exc()


def numpy_reference(ckpt, steps):
    """(prompt, max_seq, model, logits, tokens): a 9-token prompt and numpy's greedy tokens and
    logits at every step after it, with the GPU's bf16 KV rounding."""
    cfg = ckpt.config
    prompt = np.random.default_rng(11).integers(0, cfg.vocab_size, 9).tolist()
    max_seq = len(prompt) + steps + 8
    ref = Model(cfg, load_weights(ckpt), max_seq=max_seq, kv_bf16=True)
    ref.reset()
    ref_logits = [ref.prefill(prompt)]
    toks = [int(np.argmax(ref_logits[0]))]
    for _ in range(steps - 1):
        ref_logits.append(ref.decode_step(toks[-1]))
        toks.append(int(np.argmax(ref_logits[-1])))
    return prompt, max_seq, ref, ref_logits, toks


def check_model(tag, path, comm, steps, hf_ok):
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    t0 = time.time()
    prompt, max_seq, ref, ref_logits, toks = numpy_reference(ckpt, steps)
    # the token-by-token prefill: numpy's arithmetic up to summation order (check_prefill
    # compares the batched one with it)
    gpu = GpuModel(cfg, comm, max_seq=max_seq, prefill="gemv").load(ckpt)
    # teacher-forced logits on the GPU
    gpu.reset()
    errs = [rel(gpu.prefill(prompt), ref_logits[0])]
    agree = [int(np.argmax(ref_logits[0])) == toks[0]]
    for i in range(1, steps):
        g = gpu.decode_step(toks[i - 1])
        errs.append(rel(g, ref_logits[i]))
        agree.append(int(np.argmax(g)) == toks[i])
    worst = int(np.argmax(errs))
    record(f"{tag} logits vs numpy", max(errs) <= BOUND and all(agree), max_rel=max(errs), at_step=worst,
           argmax_agree=f"{sum(agree)}/{len(agree)}")
    # the fast path: greedy on the device, in the graph
    res = gpu.generate(prompt, steps, Sampling())
    d = first_diff(res.tokens, toks)
    record(f"{tag} greedy tokens (graph)", d < 0, steps=len(res.tokens), first_diff=d,
           tokens_per_s=res.tokens_per_s)
    res_e = gpu.generate(prompt, min(steps, 16), Sampling(), use_graph=False)
    d = first_diff(res_e.tokens, toks[:len(res_e.tokens)])
    record(f"{tag} greedy tokens (eager)", d < 0, steps=len(res_e.tokens), first_diff=d)
    # sampling
    s1 = gpu.generate(prompt, steps, Sampling(temperature=0.7, top_k=1, seed=3))
    record(f"{tag} sample top_k=1 == greedy", first_diff(s1.tokens, toks) < 0, first_diff=first_diff(s1.tokens, toks))
    sp = gpu.generate(prompt, steps, Sampling(temperature=1.3, top_p=1e-6, seed=4))
    record(f"{tag} sample top_p=1e-6 == greedy", first_diff(sp.tokens, toks) < 0, first_diff=first_diff(sp.tokens, toks))
    # a temperature far above the logits' spread: the draw is close to uniform over the top 5,
    # so tokens that all equal the argmax would mean the sampler ignores its seed
    temp = float(1e3 * max(1.0, np.std(ref_logits[0])))
    sa = gpu.generate(prompt, steps, Sampling(temperature=temp, top_k=5, seed=5))
    sb = gpu.generate(prompt, steps, Sampling(temperature=temp, top_k=5, seed=5))
    sc = gpu.generate(prompt, steps, Sampling(temperature=temp, top_k=5, seed=6))
    record(f"{tag} sample seeded repeat", sa.tokens == sb.tokens and sa.tokens != toks, temperature=temp,
           differs_from_other_seed=sa.tokens != sc.tokens, differs_from_greedy=sa.tokens != toks)
    ref.reset()
    lg = ref.prefill(prompt)
    inside = 0
    for i, t in enumerate(sa.tokens):
        top = np.argsort(-lg, kind="stable")[:5]
        margin_ok = lg[t] >= lg[top[-1]] - 1e-3 * max(1.0, abs(lg[top[-1]]))
        inside += int(t in top or margin_ok)
        if i + 1 < len(sa.tokens):
            lg = ref.decode_step(t)
    record(f"{tag} sample top_k=5 in reference top 5", inside == len(sa.tokens), inside=f"{inside}/{len(sa.tokens)}")
    # bad input, then the engine still works
    try:
        gpu.generate([cfg.vocab_size + 5], 2)
        record(f"{tag} error: token out of range", False, raised="nothing")
    except (KieError, ValueError) as e:
        record(f"{tag} error: token out of range", "vocabulary" in str(e), raised=type(e).__name__)
    try:
        gpu.generate(prompt, max_seq, Sampling())
        record(f"{tag} error: prompt too long", False, raised="nothing")
    except PromptTooLongError as e:
        record(f"{tag} error: prompt too long", True, raised=type(e).__name__)
    again = gpu.generate(prompt, 8, Sampling())
    record(f"{tag} works after errors", again.tokens == toks[:8])
    if hf_ok and cfg.dtp_delay == 0:
        check_hf(tag, path, prompt, toks, gpu, ref_logits)
    gpu.close()
    return time.time() - t0


def check_hf(tag, path, prompt, toks, gpu, ref_logits):
    import torch
    import transformers
    dev = f"cuda:{gpu.device}"
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(dev)
    hf.eval()
    ids = torch.tensor([prompt + toks[:-1]], device=dev)
    with torch.no_grad():
        want = hf(ids).logits[0, len(prompt) - 1:].float().cpu().numpy()
    gpu.reset()
    got = [gpu.prefill(prompt)] + [gpu.decode_step(t) for t in toks[:-1]]
    errs = [rel(g, w) for g, w in zip(got, want)]
    record(f"{tag} logits vs transformers", max(errs) <= HF_BOUND, max_rel=max(errs),
           numpy_f32_vs_hf=rel(np.stack(ref_logits), want))
    # transformers' own greedy tokens, with its cache
    seq = list(prompt)
    with torch.no_grad():
        out = hf(torch.tensor([seq], device=dev), use_cache=True)
        past, hf_toks = out.past_key_values, []
        for _ in range(len(toks)):
            t = int(out.logits[0, -1].argmax())
            hf_toks.append(t)
            out = hf(torch.tensor([[t]], device=dev), past_key_values=past, use_cache=True)
            past = out.past_key_values
    res = gpu.generate(prompt, len(toks), Sampling())
    record(f"{tag} greedy tokens vs transformers", res.tokens == hf_toks, first_diff=first_diff(res.tokens, hf_toks))
    del hf
    torch.cuda.empty_cache()


def top2_margin(logits):
    a = np.sort(logits)[-2:]
    return float(a[1] - a[0])


# The batched prefill's passes and its attention's shape: the default (the long query tiles split
# across two blocks, 32-key tiles) in passes of 64 and of 256, launch order, zigzag, 64-key tiles
# in passes of 64 and of 256, the sublayers' products added in f32 by their GEMMs.
PREFILL_TUNINGS = [{"prefill_chunk": 64}, {"prefill_chunk": 256}, {"prefill_chunk": 64, "prefill_attn": 1},
                   {"prefill_chunk": 256, "prefill_attn": 2},
                   {"prefill_chunk": 64, "prefill_attn_keys": 64}, {"prefill_chunk": 256, "prefill_attn_keys": 64},
                   {"prefill_chunk": 256, "prefill_f32_sums": 1}]


def check_prefill(tag, path, comm, steps):
    """The batched prefill (cuBLAS GEMMs over a chunk, bf16 activations) against the
    token-by-token one: the last logits within PF_BOUND and the same argmax, and the same
    greedy tokens after it; prompts shorter than, equal to and longer than a pass, so that
    several passes and a pass boundary are crossed, for each of PREFILL_TUNINGS."""
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    rng = np.random.default_rng(13)
    lens = [9, 64, 150, 300]
    max_seq = max(lens) + steps + 8
    gv = GpuModel(cfg, comm, max_seq=max_seq, prefill="gemv").load(ckpt)
    for tuning in PREFILL_TUNINGS:
        gm = GpuModel(cfg, comm, max_seq=max_seq, prefill="gemm", tuning=tuning).load(ckpt)
        name = f"{tag} " + ",".join(f"{k}={v}" for k, v in tuning.items())
        if gm.info()["prefill_chunk"] != tuning["prefill_chunk"]:
            record(f"{name}: batched prefill in use", False, info=gm.info()["prefill_chunk"])
        for n in lens:
            prompt = rng.integers(0, cfg.vocab_size, n).tolist()
            gv.reset()
            gm.reset()
            want, got = gv.prefill(prompt), gm.prefill(prompt)
            e = rel(got, want)
            same = int(np.argmax(got)) == int(np.argmax(want))
            record(f"{name}: prefill {n} tokens, batched vs token by token", e <= PF_BOUND and same, max_rel=e,
                   argmax_equal=same, top2_margin=top2_margin(want))
            a = gv.generate(prompt, steps, Sampling())
            b = gm.generate(prompt, steps, Sampling())
            record(f"{name}: prefill {n} tokens, greedy tokens after it", a.tokens == b.tokens,
                   first_diff=first_diff(b.tokens, a.tokens), steps=len(a.tokens))
        gm.close()
    gv.close()


# The graph path's other decode attentions: the monokernel's split items, and the shared-memory
# kernel cut into splits (16 and 40 keys a block, then splits of as many or of 24: several splits,
# the last combining) where the default holds a context this short in one block, a block a
# query head and a block a KV head's query heads, at any context; and at most 2 or 1 splits, whose
# blocks walk their keys in chunks of 16 (an online softmax across chunks).  Then the step
# clock's kernels (the pipelined GEMVs, the unpipelined ones, the attention in splits), which
# must not change a result; the QKV and o GEMVs on a block an SM; and the weights' loads without L2's
# evict_first policy (pipelined and not), a cache hint that must not change a result either; and the
# o GEMV letting gate/up launch before its wait; the normed GEMVs staging gamma and the RoPE row
# in shared memory before their wait (gemv_early=1); the GEMVs asking for the largest
# shared-memory carveout; and the attention's warm pass before its wait (in one block, in splits,
# a KV head's query heads together with the step clock), which must not change a result; and the
# sublayers' sums added by the normed GEMVs instead of written into the residual by the o and down
# GEMVs (gemv_residual=2), with the clock, unpipelined and with x through L1, and the default
# (the o and down GEMVs' residual epilogue) unpipelined and with x through L1; and the split
# combine in one pass (att_combine=1), in splits of a KV head's query heads, of one query head, with
# more than 16 splits (its second round trip) and in the split items (decode_attn=1).
DECODE_TUNINGS = [{"decode_attn": 1}, {"att_keys": 16}, {"att_keys": 40}, {"att_keys": 40, "att_split_keys": 24},
                  {"att_heads": 1}, {"att_heads": 1, "att_keys": 16}, {"att_heads": 2},
                  {"att_heads": 2, "att_keys": 16}, {"att_keys": 16, "att_splits": 2},
                  {"att_keys": 16, "att_splits": 1, "att_heads": 1},
                  {"step_clock": 1}, {"step_clock": 1, "gemv_pipe": 0}, {"step_clock": 1, "att_keys": 16},
                  {"qkv_blocks_per_sm": 1, "o_blocks_per_sm": 1}, {"l2_evict_first": 0},
                  {"l2_evict_first": 0, "gemv_pipe": 0}, {"o_trigger_early": 1, "o_blocks_per_sm": 1},
                  {"gemv_early": 1}, {"gemv_early": 1, "step_clock": 1}, {"gemv_carveout": 100},
                  {"att_warm": 1}, {"att_warm": 1, "att_keys": 16}, {"att_warm": 1, "att_heads": 2, "step_clock": 1},
                  {"gemv_residual": 2}, {"gemv_residual": 2, "step_clock": 1}, {"gemv_residual": 2, "gemv_pipe": 0},
                  {"gemv_residual": 2, "gemv_x_l1": 1}, {"gemv_pipe": 0}, {"gemv_x_l1": 1},
                  {"att_combine": 1, "att_keys": 16}, {"att_combine": 1, "att_keys": 16, "att_heads": 1},
                  {"att_combine": 1, "att_keys": 16, "att_split_keys": 4, "att_splits": 20},
                  {"att_combine": 1, "decode_attn": 1}]

# Tunings that must give the default's bits, each against the same tuning without its last field:
# the attention's items on a few blocks in turn (att_blocks; 3 blocks take several items each, in one
# block a head and in splits that combine), and a block per item slot of the grid (-1).
SAME_BITS_TUNINGS = [{"att_blocks": -1}, {"att_blocks": 3}, {"att_keys": 16, "att_blocks": -1},
                     {"att_keys": 16, "att_blocks": 3}, {"att_keys": 16, "att_heads": 2, "att_blocks": 5},
                     {"att_keys": 16, "step_clock": 1, "att_blocks": 3}]


def check_same_bits(tag, path, comm, steps, tunings):
    """Teacher-forced logits of each tuning equal, to the bit, those of the tuning without its
    last field."""
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    prompt, max_seq, _, _, toks = numpy_reference(ckpt, steps)

    runs = {}  # a tuning's logits, once: several tunings share the one they are compared with

    def logits(tuning):
        key = tuple(tuning.items())
        if key not in runs:
            gpu = GpuModel(cfg, comm, max_seq=max_seq, prefill="gemv", tuning=tuning).load(ckpt)
            gpu.reset()
            out = [np.array(gpu.prefill(prompt), copy=True)]
            out += [np.array(gpu.decode_step(toks[i - 1]), copy=True) for i in range(1, steps)]
            gpu.close()
            runs[key] = out
        return runs[key]

    for tuning in tunings:
        base = dict(list(tuning.items())[:-1])
        a, b = logits(base), logits(tuning)
        same = all(np.array_equal(x, y) for x, y in zip(a, b))
        name = ",".join(f"{k}={v}" for k, v in tuning.items())
        record(f"{tag} decode {name}: the same bits as without {list(tuning)[-1]}", same,
               max_abs=max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)))


def check_decode_tunings(tag, path, comm, steps, tunings):
    """Teacher-forced logits against numpy's (the prompt through decode-shaped passes of several
    tokens, then a step a token) and greedy tokens through the graph, for each tuning."""
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    prompt, max_seq, _, ref_logits, toks = numpy_reference(ckpt, steps)
    for tuning in tunings:
        name = ",".join(f"{k}={v}" for k, v in tuning.items()) or "default"
        gpu = GpuModel(cfg, comm, max_seq=max_seq, prefill="gemv", tuning=tuning).load(ckpt)
        gpu.reset()
        errs = [rel(gpu.prefill(prompt), ref_logits[0])]
        errs += [rel(gpu.decode_step(toks[i - 1]), ref_logits[i]) for i in range(1, steps)]
        res = gpu.generate(prompt, steps, Sampling())
        d = first_diff(res.tokens, toks)
        record(f"{tag} decode {name}: logits vs numpy, greedy tokens (graph)", max(errs) <= BOUND and d < 0,
               max_rel=max(errs), first_diff=d)
        gpu.close()


def check_checkpoint(tag, path, comm, steps, hf_ok):
    secs = check_model(tag, path, comm, steps, hf_ok)
    check_prefill(tag, path, comm, steps)
    check_decode_tunings(tag, path, comm, steps, DECODE_TUNINGS)
    check_same_bits(tag, path, comm, steps, SAME_BITS_TUNINGS)
    if RANK == 0:
        print(f"  ({tag}: {secs:.1f} s)", flush=True)


def check_memory_error(comm):
    n = (1 << 21) * SIZE  # a lane's KV cache alone is past the GPU's memory
    cfg = preset("2b").replace(max_position_embeddings=n)
    try:
        GpuModel(cfg, comm, max_seq=n)
        record("error: model larger than the GPU", False, raised="nothing")
    except GpuMemoryError as e:
        record("error: model larger than the GPU", "GiB" in str(e), raised=type(e).__name__, msg=str(e)[:90])


# Decode-attention shapes and switches the engine refuses: each a GpuArgumentError naming the field.
BAD_DECODE_TUNINGS = [{"decode_attn": 3}, {"att_keys": 257}, {"att_keys": 16, "att_split_keys": 32},
                      {"att_splits": -1}, {"att_heads": 3}, {"step_clock": 2},
                      {"qkv_blocks_per_sm": 9}, {"o_blocks_per_sm": -1}, {"l2_evict_first": 2}, {"l2_evict_first": -2},
                      {"o_trigger_early": 2}, {"mono_slots": 1}, {"mono_slots": 9}, {"gemv_early": 2},
                      {"gemv_early": -1}, {"gemv_carveout": -1}, {"gemv_carveout": 101}, {"att_blocks": -2},
                      {"att_warm": 2}, {"mono_sync": 3}, {"mono_sync": -1}, {"mono_ahead": 3},
                      {"mono_ahead": -1}, {"gemv_residual": 3}, {"gemv_residual": -1},
                      {"mono_residual": 3}, {"mono_residual": -1}, {"att_combine": 3}, {"att_combine": -1},
                      {"mono_ll": 7}, {"mono_ll": -1}, {"mono_residual": 2, "mono_ll": 1}]


def check_bad_decode_tunings(comm):
    cfg = preset("tiny")
    for tuning in BAD_DECODE_TUNINGS:
        name = ",".join(f"{k}={v}" for k, v in tuning.items())
        field = list(tuning)[-1]
        try:
            GpuModel(cfg, comm, max_seq=64, tuning=tuning).close()
            record(f"error: {name}", False, raised="nothing")
        except GpuArgumentError as e:
            record(f"error: {name}", field in str(e), raised=type(e).__name__, msg=str(e)[:90])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    comm = None
    if SIZE > 1:
        import kccl
        comm = kccl.Communicator.from_mpi(WORLD, device="local", config=comm_config(preset("tiny", dtp_delay=1)))
    hf_ok = not a.no_hf
    if hf_ok:
        try:
            import transformers  # noqa: F401
        except ImportError:
            hf_ok = False
    with tempfile.TemporaryDirectory() as root:
        root = WORLD.bcast(root if RANK == 0 else None) if WORLD is not None else root
        configs = {(name, d): preset(name, dtp_delay=d) for name in a.presets.split(",") for d in (0, 1)}
        for (name, d), path in make_checkpoints(root, configs).items():
            tag = f"{name} d={d} tp={SIZE}"
            guarded(tag, check_checkpoint, tag, path, comm, a.steps, hf_ok)
        # the prefill attention's other shapes: a query head per KV head, and the head size of the
        # 2b preset (128)
        shapes = {"tiny g=1": preset("tiny").replace(num_key_value_heads=4),
                  "tiny hd=128": preset("tiny").replace(head_dim=128)}
        for name, path in make_checkpoints(root, shapes).items():
            guarded(f"{name} tp={SIZE}", check_prefill, f"{name} tp={SIZE}", path, comm, a.steps)
            guarded(f"{name} tp={SIZE}", check_decode_tunings, f"{name} tp={SIZE}", path, comm, a.steps,
                    [{}] + DECODE_TUNINGS)
        guarded("bad decode tunings", check_bad_decode_tunings, comm)
        try:
            check_memory_error(comm)
        except Exception as e:
            record("error: model larger than the GPU (crashed)", False, error=f"{type(e).__name__}: {e}")
        if WORLD is not None:
            WORLD.Barrier()
    allres = WORLD.gather(RESULTS, root=0) if WORLD is not None else [RESULTS]
    if comm is not None:
        comm.close()
    if RANK == 0:
        flat = [r for rs in allres for r in rs]
        bad = [r for r in flat if not r["ok"]]
        print(f"KIE GPU CHECK (tp={SIZE}): {len(flat) - len(bad)} passed, {len(bad)} failed", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(flat, f, indent=1, default=str)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
