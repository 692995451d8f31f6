"""Batch-1 bf16 decode on the GPU: KIE's engine (a CUDA graph per token, or the
monokernel: one persistent kernel per token) against a
PyTorch baseline on the same weights, in the same run, with this machine's copy
bandwidth, so that every row says what share of the weight-streaming floor it reaches
(weight bytes per token / copy bandwidth, over its time per token).

    python bench/decode_gpu.py --json bench/results/gpu/kie_decode_2b_1xh200.json            # TP = 1
    mpiexec -n 2 python bench/decode_gpu.py --json ...                                  # TP = 2, a GPU per rank

The weights are random (drawn on the GPU, one lane's share per rank), which is all a
speed measurement needs.  KIE rows: greedy generation through the fast path (the
device picks each token; the host reads them from a ring, a few steps ahead), timed on
the host over --tokens tokens after a prefill of `context` tokens, median of --rounds.
The baseline: a plain PyTorch Llama step (bf16, static KV cache, F.linear, SDPA),
torch.compile'd (--baseline compile) or not (--baseline graph), captured in a CUDA
graph and replayed; TP = 2 sums with torch.distributed NCCL inside the graph.
Also: the engine's GEMV alone on a 32 MB matrix and the four GEMVs of a layer."""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
for _v in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_v, "0" if _v == "NCCL_NVLS_ENABLE" else "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kie_engine.formats.config import preset  # noqa: E402
from kie_engine.generate import Sampling  # noqa: E402
from kie_engine.errors import GpuError  # noqa: E402
from kie_engine.gpu.engine import GpuModel, lib as kielib  # noqa: E402
from kie_engine.reference.model import rope_tables  # noqa: E402
from kie_engine.lanes.plan import comm_config, lane_plan  # noqa: E402

import kie_bench  # noqa: E402  (bench/kie_bench.py: the engine's benchmarks, built on first import)

try:
    from mpi4py import MPI
    WORLD = MPI.COMM_WORLD
    RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
except ImportError:
    WORLD, RANK, SIZE = None, 0, 1


def log(*a):
    if RANK == 0:
        print(*a, flush=True)


# -- weights ---------------------------------------------------------------------------------

def lane_weights(cfg, dev, seed=0):
    """This lane's random bf16 weights, (out, in) like a checkpoint's: replicated tensors
    drawn from a seed shared by every rank, shards from (seed, rank)."""
    lp = lane_plan(cfg, RANK, SIZE)
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, cols = lp.n_heads * hd, lp.n_kv_heads * hd, lp.c1 - lp.c0
    gen = torch.Generator(device=dev)

    def mat(rows, cin, key, scale=None):
        gen.manual_seed(seed * 1_000_003 + key)
        s = (1.0 / cin ** 0.5) if scale is None else scale
        return (torch.randn(rows, cin, device=dev, generator=gen) * s).to(torch.bfloat16).contiguous()

    def vec(n, key):
        gen.manual_seed(seed * 1_000_003 + key)
        return (1.0 + 0.1 * torch.randn(n, device=dev, generator=gen)).float()

    shard = 1000 * (RANK + 1)
    w = {"embed": mat(cfg.vocab_size, h, 1, scale=1.0), "norm": vec(h, 2),
         "head": mat(lp.part, h, 3 + shard), "layers": []}
    for i in range(cfg.num_hidden_layers):
        k = 10 + 10 * i
        w["layers"].append({"wqkv": mat(q + 2 * kv, h, k + shard), "wo": mat(h, q, k + 1 + shard),
                            "wgu": mat(2 * cols, h, k + 2 + shard), "wd": mat(h, cols, k + 3 + shard),
                            "n1": vec(h, k + 4), "n2": vec(h, k + 5)})
    return w


def variant_name(v):
    """A variant's fields as the rows and --variant write them: FIELD=N[,FIELD=N]."""
    return ",".join(f"{k}={x}" for k, x in v.items())


def kie_variant(cfg, w, comm, max_seq, v):
    """kie_engine for a variant of VARIANTS or PREFILL_VARIANTS: its launch switches (pdl,
    prefetch) as GpuModel's arguments, the rest as kie_shape fields."""
    kw = dict(v)
    return kie_engine(cfg, w, comm, max_seq, pdl=kw.pop("pdl", None), prefetch=kw.pop("prefetch", None), tuning=kw)


def kie_engine(cfg, w, comm, max_seq, pdl=None, prefetch=None, tuning=None, kernel="graph", prefill=None):
    m = GpuModel(cfg, comm, max_seq=max_seq, pdl=pdl, prefetch=prefetch, tuning=tuning, kernel=kernel,
                 prefill=prefill)
    L = kielib
    m.upload_matrix(L.KIE_W_EMBED, 0, w["embed"])
    m.upload_matrix(L.KIE_W_HEAD, 0, w["head"])
    m.upload_vector(L.KIE_F_FINAL_NORM, 0, w["norm"].cpu().numpy())
    for i, y in enumerate(w["layers"]):
        m.upload_matrix(L.KIE_W_QKV, i, y["wqkv"])
        m.upload_matrix(L.KIE_W_O, i, y["wo"])
        m.upload_matrix(L.KIE_W_GATE_UP, i, y["wgu"])
        m.upload_matrix(L.KIE_W_DOWN, i, y["wd"])
        m.upload_vector(L.KIE_F_ATTN_NORM, i, y["n1"].cpu().numpy())
        m.upload_vector(L.KIE_F_MLP_NORM, i, y["n2"].cpu().numpy())
    return m


# -- the PyTorch baseline --------------------------------------------------------------------

class TorchDecoder:
    """A plain Llama decode step in PyTorch (bf16, static KV cache of max_seq positions,
    attention over the cache with positions past `pos` masked), one lane's share."""

    def __init__(self, cfg, w, max_seq, group=None):
        lp = lane_plan(cfg, RANK, SIZE)
        self.cfg, self.w, self.group, self.lp = cfg, w, group, lp
        dev = w["embed"].device
        self.nh, self.nkv, self.hd = lp.n_heads, lp.n_kv_heads, cfg.head_dim
        self.max_seq = max_seq
        cos, sin = rope_tables(cfg.head_dim, max_seq, cfg.rope_theta)
        self.cos = torch.tensor(cos, device=dev)
        self.sin = torch.tensor(sin, device=dev)
        L = cfg.num_hidden_layers
        self.kc = torch.zeros(L, self.nkv, max_seq, self.hd, dtype=torch.bfloat16, device=dev)
        self.vc = torch.zeros_like(self.kc)
        self.ar = torch.arange(max_seq, device=dev)
        self.gathered = torch.empty(SIZE * lp.part, device=dev, dtype=torch.bfloat16)

    def norm(self, x, g):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * g).to(torch.bfloat16)

    def rope(self, x, c, s):
        half = self.hd // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(torch.bfloat16)

    def sum(self, y):
        if self.group is not None:
            torch.distributed.all_reduce(y, group=self.group)
        return y

    def step(self, tok, pos):
        """tok, pos: int64 tensors of shape (1,); returns the next token (1,)."""
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = self.w["embed"][tok]
        c, s = self.cos[pos], self.sin[pos]
        mask = (self.ar > pos).view(1, 1, -1)
        for i, y in enumerate(self.w["layers"]):
            h = self.norm(x, y["n1"])
            qkv = F.linear(h, y["wqkv"])
            q = self.rope(qkv[:, :nh * hd].view(nh, hd), c, s)
            k = self.rope(qkv[:, nh * hd:(nh + nkv) * hd].view(nkv, hd), c, s)
            v = qkv[:, (nh + nkv) * hd:].view(nkv, hd)
            self.kc[i].index_copy_(1, pos, k.unsqueeze(1))
            self.vc[i].index_copy_(1, pos, v.unsqueeze(1))
            qg = q.view(nkv, nh // nkv, hd)
            att = torch.matmul(qg, self.kc[i].transpose(1, 2)).float() * (1.0 / hd ** 0.5)
            att = att.masked_fill(mask, float("-inf")).softmax(-1).to(torch.bfloat16)
            o = torch.matmul(att, self.vc[i]).reshape(1, nh * hd)
            x = x + self.sum(F.linear(o, y["wo"]))
            h = self.norm(x, y["n2"])
            gu = F.linear(h, y["wgu"])
            cols = gu.shape[1] // 2
            x = x + self.sum(F.linear(F.silu(gu[:, :cols]) * gu[:, cols:], y["wd"]))
        logits = F.linear(self.norm(x, self.w["norm"]), self.w["head"]).view(-1)
        if self.group is not None:
            torch.distributed.all_gather_into_tensor(self.gathered, logits, group=self.group)
            logits = self.gathered[:self.cfg.vocab_size]
        return logits.argmax().view(1)


class TorchFastDecoder(TorchDecoder):
    """The strongest plain-PyTorch step written here: attention only over the filled
    positions (SDPA on the cache's first L positions, L the position rounded up to a
    multiple of BUCKET, the rest of that bucket masked), the dense work of each sublayer
    torch.compile'd once (the same shapes every layer and step), the lanes' sums outside
    the compiled parts, and one CUDA graph per bucket."""
    BUCKET = 64

    def __init__(self, cfg, w, max_seq, group=None, compile_it=True):
        super().__init__(cfg, w, max_seq, group)
        cc = (lambda f: torch.compile(f, fullgraph=True, dynamic=False)) if compile_it else (lambda f: f)
        self.pre, self.mlp_in = cc(self._pre), cc(self._mlp_in)

    def _pre(self, x, n1, wqkv, c, s):
        nh, nkv, hd = self.nh, self.nkv, self.hd
        qkv = F.linear(self.norm(x, n1), wqkv)
        q = self.rope(qkv[:, :nh * hd].view(nh, hd), c, s)
        k = self.rope(qkv[:, nh * hd:(nh + nkv) * hd].view(nkv, hd), c, s)
        return q, k, qkv[:, (nh + nkv) * hd:].view(nkv, hd)

    def _mlp_in(self, x, n2, wgu):
        gu = F.linear(self.norm(x, n2), wgu)
        cols = gu.shape[1] // 2
        return F.silu(gu[:, :cols]) * gu[:, cols:]

    def step(self, tok, pos, L):
        nh, hd = self.nh, self.hd
        x = self.w["embed"][tok]
        c, s = self.cos[pos], self.sin[pos]
        mask = (self.ar[:L] <= pos).view(1, 1, 1, L)
        for i, y in enumerate(self.w["layers"]):
            q, k, v = self.pre(x, y["n1"], y["wqkv"], c, s)
            self.kc[i].index_copy_(1, pos, k.unsqueeze(1))
            self.vc[i].index_copy_(1, pos, v.unsqueeze(1))
            att = F.scaled_dot_product_attention(q.view(1, nh, 1, hd), self.kc[i][None, :, :L], self.vc[i][None, :, :L],
                                                 attn_mask=mask, enable_gqa=True)
            x = x + self.sum(F.linear(att.reshape(1, nh * hd), y["wo"]))
            x = x + self.sum(F.linear(self.mlp_in(x, y["n2"], y["wgu"]), y["wd"]))
        logits = F.linear(self.norm(x, self.w["norm"]), self.w["head"]).view(-1)
        if self.group is not None:
            torch.distributed.all_gather_into_tensor(self.gathered, logits, group=self.group)
            logits = self.gathered[:self.cfg.vocab_size]
        return logits.argmax().view(1)


def torch_fast_baseline(cfg, w, ctx, tokens, rounds, group):
    """us per token of TorchFastDecoder from position ctx (median of rounds), and its warm-up s."""
    dev = w["embed"].device
    B = TorchFastDecoder.BUCKET
    dec = TorchFastDecoder(cfg, w, -(-(ctx + tokens + 8) // B) * B, group)
    tok = torch.zeros(1, dtype=torch.long, device=dev)
    pos = torch.full((1,), ctx, dtype=torch.long, device=dev)
    buckets = sorted({-(-(p + 1) // B) * B for p in range(ctx, ctx + tokens)})
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for L in buckets:
            for _ in range(3):
                dec.step(tok, pos, L)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = {}
    for L in buckets:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = dec.step(tok, pos, L)
            tok.copy_(out)
            pos.add_(1)
        graphs[L] = g
    warm_s = time.perf_counter() - t0
    order = [graphs[-(-(p + 1) // B) * B] for p in range(ctx, ctx + tokens)]
    return replay_us(order, pos, ctx, rounds), warm_s


def replay_us(graphs, pos, ctx, rounds):
    """us per token of replaying `graphs` (one per token, each advancing pos) from position
    ctx: the median of rounds, timed with events."""
    times = []
    for _ in range(rounds):
        pos.fill_(ctx)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for g in graphs:
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / len(graphs))
    return statistics.median(times)


def torch_prefill_ms(cfg, w, T, rounds, compile_it, profile=None):
    """ms of a plain PyTorch prefill of T tokens (bf16, F.linear GEMMs, causal SDPA over
    the prompt, the last token's logits), eager or torch.compile'd: (min, median, max)
    over rounds after three warm-ups, and the warm-up s.  With a dict as profile, its
    "kernels" gets one timed pass's GPU time by kernel (kernel_profile)."""
    dec = TorchDecoder(cfg, w, 8)
    dev = w["embed"].device
    nh, nkv, hd = dec.nh, dec.nkv, dec.hd
    cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta)
    c, s = torch.tensor(cos, device=dev)[:, None], torch.tensor(sin, device=dev)[:, None]

    def fwd(tokens):
        x = w["embed"][tokens]
        for y in w["layers"]:
            qkv = F.linear(dec.norm(x, y["n1"]), y["wqkv"])
            q = dec.rope(qkv[:, :nh * hd].view(T, nh, hd), c, s).transpose(0, 1)[None]
            k = dec.rope(qkv[:, nh * hd:(nh + nkv) * hd].view(T, nkv, hd), c, s).transpose(0, 1)[None]
            v = qkv[:, (nh + nkv) * hd:].view(T, nkv, hd).transpose(0, 1)[None]
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + F.linear(att[0].transpose(0, 1).reshape(T, nh * hd), y["wo"])
            gu = F.linear(dec.norm(x, y["n2"]), y["wgu"])
            cols = gu.shape[1] // 2
            x = x + F.linear(F.silu(gu[:, :cols]) * gu[:, cols:], y["wd"])
        return F.linear(dec.norm(x[-1:], w["norm"]), w["head"])

    fn = torch.compile(fwd, dynamic=False) if compile_it else fwd
    tokens = torch.randint(0, cfg.vocab_size, (T,), device=dev, generator=torch.Generator(device=dev).manual_seed(T))
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(3):
            fn(tokens)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        ms = []
        for _ in range(rounds):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(tokens)
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        if profile is not None:
            profile["kernels"] = kernel_profile(lambda: fn(tokens), top=24)
    return (min(ms), statistics.median(ms), max(ms)), warm


def kernel_profile(fn, top=14):
    """GPU time of every kernel fn() runs (the PyTorch profiler through CUPTI: the engine's
    kernels and cuBLAS's too, graph replays included), summed by kernel name: [(name,
    calls, us)], largest first."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            out.append((e.key[:90], int(e.count), round(float(us), 1)))
    out.sort(key=lambda r: -r[2])
    return out[:top]


def prefill_prompt(m, ctx):
    """The prompt of ctx tokens whose prefill the bench times and compares across variants."""
    return np.random.default_rng(ctx + 1).integers(0, m.cfg.vocab_size, ctx).tolist()


def kie_prefill_ms(m, ctx, rounds):
    """ms from the prompt going in to its next token picked on the device (GpuModel.first_token):
    (min, median, max) over rounds after one warm-up."""
    ids = prefill_prompt(m, ctx)
    ms = []
    for r in range(rounds + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.first_token(ids)
        if r:
            ms.append(1e3 * (time.perf_counter() - t0))
    m.reset()
    return min(ms), statistics.median(ms), max(ms)


def kie_prefill_logits(m, ctx):
    """The last logits of the bench's prompt of ctx tokens (the one kie_prefill_ms times)."""
    m.reset()
    out = m.prefill(prefill_prompt(m, ctx))
    m.reset()
    return out


def torch_baseline(cfg, w, ctx, tokens, rounds, compile_it, group):
    dev = w["embed"].device
    dec = TorchDecoder(cfg, w, ctx + tokens + 8, group)
    fn = torch.compile(dec.step, fullgraph=False, dynamic=False) if compile_it else dec.step
    tok = torch.zeros(1, dtype=torch.long, device=dev)
    pos = torch.full((1,), ctx, dtype=torch.long, device=dev)
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            out = fn(tok, pos)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(tok, pos)
        tok.copy_(out)
        pos.add_(1)
    return replay_us([g] * tokens, pos, ctx, rounds), warm_s


# -- measurements ----------------------------------------------------------------------------

def copy_bandwidth(dev, nbytes=2 << 30, reps=10):
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1000.0)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(ts) / 1e9


# Launch and kernel variants against the defaults (PDL on, prefetch 2: a GEMV's first
# loads before its wait, 2 GEMV blocks per SM, pipelined GEMV loads (4 per row per
# lane), x of the o and down GEMVs staged in shared memory, the decode attention a block
# a query head holding up to 192 keys in shared memory, past them splits of 96 keys a
# block a KV head): the monokernel's attention items (32 keys a split, the last
# combining), a block a KV head or a block a query head at every context, splits of 128.
VARIANTS = [dict(decode_attn=1), dict(att_heads=2), dict(att_heads=1), dict(att_split_keys=128)]


# The batched prefill against its default (the long query tiles' keys split across two attention
# blocks, 32-key tiles, kernels launched with programmatic dependent launch): the attention blocks
# in zigzag order (no split), no PDL, 64-key tiles; and the o and down products added to the
# residual in f32 by their GEMMs instead of written in bf16 for the next norm to add.
PREFILL_VARIANTS = [dict(prefill_f32_sums=1), dict(prefill_attn=2), dict(pdl=0), dict(prefill_attn_keys=64)]


# The monokernel's variants: its attention as split items (1) instead of in shared memory
# (the default), the keys one block's attention holds (default: 192 on the 2b shape, the
# most that leave its weight ring 3 slots; 64 leave it 5), and a KV head's query heads a
# block at every context.
MONO_VARIANTS = [dict(mono_attn=1), dict(att_keys=64), dict(att_keys=128), dict(att_heads=2)]


def kie_decode(m, ctx, tokens, rounds, vocab):
    rng = np.random.default_rng(ctx)
    prompt = rng.integers(0, vocab, ctx).tolist()
    us, pre = [], []
    first = None
    for _ in range(rounds):
        res = m.generate(prompt, tokens + 1, Sampling())
        us.append(1e6 * res.decode_s / res.decode_tokens)
        pre.append(1e3 * res.prefill_s)
        first = first or res.tokens
    return statistics.median(us), statistics.median(pre), first


def meta_of(a, name, gpus, bw, engine_bytes, micro):
    return {"command": " ".join(sys.argv), "gpu": name, "gpus": gpus, "ranks": SIZE, "copy_GBps": bw,
            "preset": a.preset, "tokens": a.tokens, "rounds": a.rounds,
            "weight_bytes_per_token_per_lane": engine_bytes, "micro": micro,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_json(a, rows, meta):
    """Rewritten after every row, so that a run cut short keeps what it measured."""
    if a.json and RANK == 0:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


def matmul_tflops(dev, n=8192, reps=10):
    """The bf16 matrix rate of this GPU (n x n x n through torch, random data), TFLOP/s."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1000.0)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / statistics.median(ts) / 1e12


def prefill_flops(cfg, lp, T):
    """The multiply-adds (x 2) of a prefill of T tokens on one lane: every layer's
    products for T tokens, causal attention, the LM head for the last token."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, cols = lp.n_heads * hd, lp.n_kv_heads * hd, lp.c1 - lp.c0
    layer = (q + 2 * kv) * h + h * q + 3 * cols * h
    att = 2 * lp.n_heads * hd * T * (T + 1)  # QK^T and PV over the causal half
    return cfg.num_hidden_layers * (2 * T * layer + att) + 2 * lp.part * h


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="2b")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--delays", default="0,1")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-rounds", type=int, default=5)
    ap.add_argument("--baseline", default="compile", choices=["compile", "graph", "none"],
                    help="the PyTorch baselines: compile (torch.compile + CUDA graph; prefill eager and compiled), "
                         "graph (no compile), none")
    ap.add_argument("--kernels", default="graph,mono",
                    help="KIE's step kernels to time, of graph,mono (default: both; at TP > 1 the monokernel sums "
                         "the lanes inside its kernel)")
    ap.add_argument("--variants", action="store_true",
                    help="also KIE with the launch and kernel variants of VARIANTS (delay 0, every context)")
    ap.add_argument("--variant", action="append", metavar="FIELD=N[,FIELD=N]",
                    help="a graph-path variant to time instead of VARIANTS' (repeatable; kie_shape fields, pdl, "
                         "prefetch), e.g. --variant att_split_keys=64")
    ap.add_argument("--mono-variants", action="store_true",
                    help="also the monokernel with the variants of MONO_VARIANTS (delay 0, every context)")
    ap.add_argument("--mono-variant", action="append", metavar="FIELD=N[,FIELD=N]",
                    help="a monokernel variant to time instead of MONO_VARIANTS' (repeatable; kie_shape fields)")
    ap.add_argument("--prefill-variants", action="store_true",
                    help="also KIE's batched prefill with the variants of PREFILL_VARIANTS (their last logits "
                         "against the default's)")
    ap.add_argument("--profile", action="store_true",
                    help="also the GPU time of each kernel of a prefill and of 8 graph decode steps (PyTorch profiler)")
    ap.add_argument("--json")
    a = ap.parse_args()
    def parse_variants(given, flag):
        try:
            return [{k: int(x) for k, x in (kv.split("=") for kv in v.split(","))} for v in given]
        except ValueError:
            ap.error(f"{flag} {given}: FIELD=N[,FIELD=N], N an integer")

    variants, mono_variants = VARIANTS, MONO_VARIANTS
    if a.variant:
        variants, a.variants = parse_variants(a.variant, "--variant"), True
    if a.mono_variant:
        mono_variants, a.mono_variants = parse_variants(a.mono_variant, "--mono-variant"), True
    ndev = torch.cuda.device_count()
    dev_index = RANK % ndev
    torch.cuda.set_device(dev_index)
    dev = torch.device("cuda", dev_index)
    gpus = min(SIZE, ndev)
    contexts = [int(c) for c in a.contexts.split(",")]
    kernels = a.kernels.split(",")
    delays = [int(d) for d in a.delays.split(",")]
    max_seq = max(contexts) + a.tokens + 8
    base = preset(a.preset)
    comm = group = None
    if SIZE > 1:
        import kccl
        comm = kccl.Communicator.from_mpi(WORLD, device="local", config=comm_config(base.replace(dtp_delay=max(delays))))
        if a.baseline != "none":
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(WORLD.bcast(29500 + os.getpid() % 1000 if RANK == 0 else None)))
            torch.distributed.init_process_group("nccl", rank=RANK, world_size=SIZE, device_id=dev)
            group = torch.distributed.group.WORLD
    name = torch.cuda.get_device_name(dev)
    bw = copy_bandwidth(dev)
    tflops = matmul_tflops(dev)
    log(f"# {name} x {gpus} GPU(s), {SIZE} rank(s); copy bandwidth {bw:.0f} GB/s (read + write, 2 GiB); "
        f"bf16 matmul {tflops:.0f} TFLOP/s (8192^3)")
    w = lane_weights(base, dev)
    lp = lane_plan(base, RANK, SIZE)
    rows, micro = [], {"matmul_tflops": tflops}

    def add(engine, kernel, delay, ctx, us, extra=None):
        wb = engine_bytes
        row = {"engine": engine, "kernel": kernel, "tp": SIZE, "gpus": gpus, "dtp_delay": delay, "context": ctx,
               "tokens_per_s": 1e6 / us, "us_per_token": us, "floor_share": (wb / (bw * 1e9)) / (us * 1e-6)}
        row.update(extra or {})
        rows.append(row)
        write_json(a, rows, meta_of(a, name, gpus, bw, engine_bytes, micro))
        log(f"{engine:5s} {kernel:13s} tp={SIZE} d={delay} ctx={ctx:5d}  {1e6 / us:8.1f} tokens/s  {us:8.1f} us/token"
            f"  {100 * row['floor_share']:5.1f} % of floor" + "".join(f"  {k}={v}" for k, v in (extra or {}).items()))

    def add_prefill(engine, kernel, ctx, mmm, extra=None):
        """A prefill row: tokens_per_s the prompt's tokens per second, floor_share its share of the
        compute floor (the prefill's FLOPs at the measured matmul rate)."""
        ms = mmm[1]
        row = {"engine": engine, "kernel": kernel, "tp": SIZE, "gpus": gpus, "dtp_delay": 0, "context": ctx,
               "prefill_ms": round(ms, 3), "prefill_ms_min_max": [round(mmm[0], 3), round(mmm[2], 3)],
               "tokens_per_s": ctx / ms * 1e3,
               "floor_share": prefill_flops(base, lp, ctx) / (tflops * 1e12) / (ms * 1e-3)}
        row.update(extra or {})
        rows.append(row)
        write_json(a, rows, meta_of(a, name, gpus, bw, engine_bytes, micro))
        log(f"{engine:5s} {kernel:13s} tp={SIZE} prompt={ctx:5d}  {ms:8.2f} ms (min {mmm[0]:.2f}, max {mmm[2]:.2f})  "
            f"{ctx / ms * 1e3:9.0f} tokens/s  {100 * row['floor_share']:5.1f} % of the compute floor"
            + (f"  [{row['variant']}: logits {row['logits_rel_diff_vs_default']:.1e} from the default's, argmax "
               f"{'same' if row['same_argmax'] else 'DIFFERENT'}]" if "variant" in row else "")
            + "".join(f"  {k}={v}" for k, v in (extra or {}).items()))

    engine_bytes = None
    kie_prefill = {}
    for d in delays:
        cfg = base.replace(dtp_delay=d)
        m = kie_engine(cfg, w, comm, max_seq)
        engine_bytes = m.weight_bytes_per_token()
        if d == delays[0]:
            info = m.info()
            log(f"# KIE: {engine_bytes / 1e9:.3f} GB of weights per token per lane; floor {engine_bytes / bw / 1e3:.1f} us;"
                f" prefill {m.prefill_note}; {info}")
            for rws, cols in ((8192, 2048), (2048, 1024), (2048, 8192)):
                us = kie_bench.bench_gemv(m, rws, cols, iters=100)
                micro[f"gemv_{rws}x{cols}"] = {"us": us, "GBps": rws * cols * 2 / us / 1e3,
                                               "share": rws * cols * 2 / us / 1e3 / bw}
                log(f"# GEMV {rws} x {cols} ({rws * cols * 2 / 2**20:.0f} MiB): {us:.2f} us, "
                    f"{rws * cols * 2 / us / 1e3:.0f} GB/s, {100 * micro[f'gemv_{rws}x{cols}']['share']:.0f} % of copy")
            us = kie_bench.bench_layer_gemvs(m, iters=50)
            lb = (engine_bytes - 2 * m.lane.part * cfg.hidden_size) / cfg.num_hidden_layers
            micro["layer_gemvs"] = {"us": us, "GBps": lb / us / 1e3, "share": lb / us / 1e3 / bw}
            log(f"# one layer's four GEMVs ({lb / 2**20:.0f} MiB): {us:.2f} us, {lb / us / 1e3:.0f} GB/s, "
                f"{100 * lb / us / 1e3 / bw:.0f} % of copy")
            for ctx in contexts:
                kie_prefill[ctx] = kie_prefill_ms(m, ctx, a.prefill_rounds)
                add_prefill("kie", "prefill " + ("gemm" if m.info()["prefill_chunk"] else "gemv"), ctx,
                            kie_prefill[ctx], {"prefill": m.prefill_note})
            if a.prefill_variants and m.info()["prefill_chunk"]:
                ref = {ctx: kie_prefill_logits(m, ctx) for ctx in contexts}
                for v in PREFILL_VARIANTS:
                    mv = kie_variant(cfg, w, comm, max_seq, v)
                    for ctx in contexts:
                        got = kie_prefill_logits(mv, ctx)
                        rel = float(np.abs(got - ref[ctx]).max() / np.abs(ref[ctx]).max())
                        add_prefill("kie", "prefill gemm", ctx, kie_prefill_ms(mv, ctx, a.prefill_rounds),
                                    {"variant": variant_name(v),
                                     "logits_rel_diff_vs_default": rel,
                                     "same_argmax": int(got.argmax()) == int(ref[ctx].argmax())})
                    mv.close()
            if a.profile:  # where a prefill's and a decode step's GPU time goes, kernel by kernel
                for ctx in contexts:
                    ids = np.random.default_rng(ctx).integers(0, cfg.vocab_size, ctx).tolist()
                    micro[f"kernels_prefill_{ctx}"] = kernel_profile(lambda: m.first_token(ids), top=24)
                    log(f"# prefill of {ctx} tokens, GPU us by kernel: {micro[f'kernels_prefill_{ctx}']}")
                m.reset()
                m.prefill(list(range(min(contexts))))
                micro["kernels_graph_8_steps"] = kernel_profile(lambda: kie_bench.bench_steps(m, 8))
                log(f"# 8 graph decode steps at context {min(contexts)}, GPU us by kernel: {micro['kernels_graph_8_steps']}")
                m.reset()
            if m.info()["prefill_chunk"]:  # the token-by-token prefill beside it, at the shortest context
                mg = kie_engine(cfg, w, comm, max_seq, prefill="gemv")
                ctx = min(contexts)
                add_prefill("kie", "prefill gemv", ctx, kie_prefill_ms(mg, ctx, 2))
                mg.close()
        graph_tokens = {}
        for kernel in kernels:
            if kernel != "graph":
                m.close()
                m = kie_engine(cfg, w, comm, max_seq, kernel=kernel)
            for ctx in contexts:
                us, pre, toks = kie_decode(m, ctx, a.tokens, a.rounds, cfg.vocab_size)
                m.reset()
                m.prefill(list(range(ctx)))
                ev = kie_bench.bench_steps(m, a.tokens)
                pf = kie_prefill.get(ctx, (pre, pre, pre))
                extra = {"prefill_ms": round(pf[1], 2), "events_us": round(ev, 1)}
                if kernel == "mono":  # where the last step's time went, from every block's clocks
                    extra["stage_us"] = kie_bench.mono_profile(m)
                    log(f"# mono ctx {ctx} (every block, us over the step): {extra['stage_us']}")
                if kernel == "graph":
                    graph_tokens[ctx] = toks
                elif ctx in graph_tokens:  # the monokernel's arithmetic is the graph path's: same tokens
                    extra["same_tokens_as_graph"] = toks == graph_tokens[ctx]
                add("kie", kernel, d, ctx, us, extra)
            info = m.info()
            log(f"# delay {d}, {kernel}: {info['graph_nodes']} graph nodes per step"
                + (f", weight ring {info['mono_slots']} x {info['mono_slot_bytes'] // 1024} KiB, "
                   f"{info['mono_smem'] // 1024} KiB of shared memory per block" if kernel == "mono" else ""))
        m.close()
        if a.mono_variants and "mono" in kernels and d == delays[0]:
            for v in mono_variants:
                vname = variant_name(v)
                mv = None
                try:  # a variant that fails (a stalled step: GpuError) is a row that says so, not the run's end
                    mv = kie_engine(cfg, w, comm, max_seq, tuning=v, kernel="mono")
                    for ctx in contexts:
                        us, pre, toks = kie_decode(mv, ctx, a.tokens, a.rounds, cfg.vocab_size)
                        mv.reset()
                        mv.prefill(list(range(ctx)))
                        kie_bench.bench_steps(mv, a.tokens)
                        stage = kie_bench.mono_profile(mv)
                        log(f"# mono ctx {ctx}, {vname} (every block, us over the step): {stage}")
                        add("kie", "mono", d, ctx, us, {"variant": vname, "stage_us": stage,
                                                        "same_tokens_as_graph": toks == graph_tokens.get(ctx)})
                except GpuError as e:  # kept in the JSON's meta, beside the rows that ran
                    log(f"# mono {vname} failed: {type(e).__name__}: {e}")
                    micro.setdefault("failed_variants", []).append(
                        {"kernel": "mono", "dtp_delay": d, "variant": vname, "error": f"{type(e).__name__}: {e}"})
                finally:
                    if mv is not None:
                        mv.close()
        if a.variants and d == delays[0]:
            for v in variants:
                mv = kie_variant(cfg, w, comm, max_seq, v)
                lay = kie_bench.bench_layer_gemvs(mv, iters=50)
                down = kie_bench.bench_gemv(mv, 2048, 8192, iters=100)
                for ctx in contexts:
                    us, pre, toks = kie_decode(mv, ctx, a.tokens, a.rounds, cfg.vocab_size)
                    extra = {"variant": variant_name(v), "layer_gemvs_us": round(lay, 2),
                             "gemv_2048x8192_us": round(down, 2), "same_tokens_as_graph": toks == graph_tokens.get(ctx)}
                    if v.get("step_clock"):  # where the step's time went, from every block's clocks
                        mv.reset()
                        mv.prefill(list(range(ctx)))
                        kie_bench.bench_steps(mv, 8)
                        extra["clock_us"] = kie_bench.graph_profile(mv)
                        log(f"# graph ctx {ctx}, {extra['variant']} (every block, us over the step): {extra['clock_us']}")
                    add("kie", "graph", d, ctx, us, extra)
                mv.close()
    if a.baseline != "none":
        comp = a.baseline == "compile"
        torch_pf = {}
        for ctx in contexts:
            if SIZE == 1:
                eager, _ = torch_prefill_ms(base, w, ctx, a.prefill_rounds, False)
                add_prefill("torch", "prefill eager", ctx, eager)
                torch_pf[ctx] = eager
                if comp:
                    prof = {} if a.profile else None
                    cmp_, warm = torch_prefill_ms(base, w, ctx, a.prefill_rounds, True, prof)
                    if prof:
                        micro[f"torch_compile_kernels_prefill_{ctx}"] = prof["kernels"]
                        log(f"# torch.compile prefill of {ctx} tokens, GPU us by kernel: {prof['kernels']}")
                    add_prefill("torch", "prefill compile", ctx, cmp_, {"warmup_s": round(warm, 1)})
                    torch_pf[ctx] = min(eager, cmp_, key=lambda t: t[1])
            pf = {"prefill_ms": round(torch_pf[ctx][1], 2)} if ctx in torch_pf else {}
            us, warm = torch_baseline(base, w, ctx, a.tokens, a.rounds, comp, group)
            add("torch", "compile+graph" if comp else "graph", 0, ctx, us, {"warmup_s": round(warm, 1), **pf})
            us, warm = torch_fast_baseline(base, w, ctx, a.tokens, a.rounds, group)
            add("torch", "fast+graph", 0, ctx, us, {"warmup_s": round(warm, 1), **pf})
    write_json(a, rows, meta_of(a, name, gpus, bw, engine_bytes, micro))
    if RANK == 0:
        for r in rows:
            if r["engine"] != "kie" or "variant" in r:
                continue
            if r["kernel"].startswith("prefill"):  # against the faster PyTorch prefill of that prompt
                t = [b for b in rows if b["engine"] == "torch" and b["kernel"].startswith("prefill")
                     and b["context"] == r["context"]]
                if t:
                    r["vs_torch"] = min(b["prefill_ms"] for b in t) / r["prefill_ms"]
                continue
            t = [b for b in rows if b["engine"] == "torch" and not b["kernel"].startswith("prefill")
                 and b["context"] == r["context"]]
            if t:  # against the stronger baseline
                r["vs_torch"] = r["tokens_per_s"] / max(b["tokens_per_s"] for b in t)
        log("\n engine kernel         tp gpus d   ctx   tokens/s   us/token  floor  prefill ms  vs torch")
        for r in rows:
            vs = f"{r['vs_torch']:6.2f}x" if "vs_torch" in r else "      "
            us = f"{r['us_per_token']:10.1f}" if "us_per_token" in r else " " * 10
            pf = f"{r['prefill_ms']:10.2f}" if "prefill_ms" in r else " " * 10
            log(f" {r['engine']:6s} {r['kernel']:14s} {r['tp']:2d} {r['gpus']:4d} {r['dtp_delay']} {r['context']:5d} "
                f"{r['tokens_per_s']:10.1f} {us} {100 * r['floor_share']:5.1f}% {pf}  {vs}"
                + ("" if "variant" not in r else f"  {r['variant']}")
                + ("" if "layer_gemvs_us" not in r else f" layer={r['layer_gemvs_us']} us"))
        write_json(a, rows, meta_of(a, name, gpus, bw, engine_bytes, micro))
        if a.json:
            log(f"wrote {a.json}")
    if group is not None:
        torch.distributed.destroy_process_group()
    if comm is not None:
        comm.close()


if __name__ == "__main__":
    main()
