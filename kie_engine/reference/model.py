"""A Llama-style decoder in numpy, float32 compute: RMSNorm, RoPE, grouped-query
attention with a KV cache, SwiGLU MLP, optional tied embeddings, and the DTP
residual schedule (config.dtp_delay; 0 = exactly Llama).

This file knows nothing about parallelism.  A model holds some number of query/KV
heads and MLP columns (all of them, or one lane's share: lanes/plan.py decides) and hands
the partial output of every sublayer to `lanes`, an object with
    sum(y)        -> the sum of y over all lanes (y may be reused as the result)
    sum_start(y)  -> a handle whose wait() returns that sum later
    vocab(logits) -> the logits of the whole vocabulary from this lane's slice
`OneLane` is the trivial implementation (everything is already whole).

Weights are stored transposed, (in, out) row-major: a decode step is then one
vector-matrix product x @ W per matrix, which streams W once; OpenBLAS's kernel
for this layout measured ~24 GB/s on one core here against ~17-19 GB/s for the
checkpoint's (out, in) layout with W @ x."""
import math
from collections import deque
from dataclasses import dataclass
from typing import List

import numpy as np

from ..errors import KieError, PromptTooLongError
from ..formats.safetensors_io import float32_to_bf16_bits


class _Ready:
    __slots__ = ("x",)

    def __init__(self, x):
        self.x = x

    def wait(self):
        return self.x


class OneLane:
    """The whole model in one process."""
    size = 1

    def sum(self, y):
        return y

    def sum_start(self, y):
        return _Ready(y)

    def vocab(self, logits):
        return logits


@dataclass
class LayerWeights:
    attn_norm: np.ndarray   # (hidden,)
    wqkv: np.ndarray        # (hidden, q + k + v): q heads, then k heads, then v heads
    wo: np.ndarray          # (q, hidden)
    mlp_norm: np.ndarray    # (hidden,)
    w_gate_up: np.ndarray   # (hidden, 2 * columns): gate columns, then up columns
    w_down: np.ndarray      # (columns, hidden)


@dataclass
class Weights:
    embed: np.ndarray       # (vocab, hidden)
    layers: List[LayerWeights]
    norm: np.ndarray        # (hidden,)
    lm_head: np.ndarray     # (hidden, vocab entries held here)
    n_heads: int            # query heads held here
    n_kv_heads: int         # KV heads held here

    @property
    def nbytes_per_token(self):
        """Bytes of weights a decode step streams (everything but the embedding table,
        which it reads one row of)."""
        mats = [m for lw in self.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
        return sum(m.nbytes for m in mats) + self.lm_head.nbytes


def stack_t(*mats):
    """Checkpoint matrices (out, in) stacked along out, as one (in, sum of outs) array."""
    return np.ascontiguousarray(np.concatenate(mats).T)


def load_weights(ckpt):
    """All of a checkpoint's weights, for one lane that holds everything."""
    cfg = ckpt.config
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        t = lambda n: ckpt.tensor(p + n)  # noqa: E731
        layers.append(LayerWeights(
            attn_norm=t("input_layernorm.weight"),
            wqkv=stack_t(t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"), t("self_attn.v_proj.weight")),
            wo=stack_t(t("self_attn.o_proj.weight")), mlp_norm=t("post_attention_layernorm.weight"),
            w_gate_up=stack_t(t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")),
            w_down=stack_t(t("mlp.down_proj.weight"))))
    embed = ckpt.tensor("model.embed_tokens.weight")
    head = stack_t(embed if cfg.tie_word_embeddings else ckpt.tensor("lm_head.weight"))
    return Weights(embed, layers, ckpt.tensor("model.norm.weight"), head,
                   cfg.num_attention_heads, cfg.num_key_value_heads)


# -- building blocks -------------------------------------------------------------------------

def linear(x, w):
    """x (T, in) @ w for w stored (in, out).  One token: a vector-matrix product."""
    if x.shape[0] == 1:
        return (x[0] @ w)[None]
    return x @ w


def fake_quant_q8(x):
    """x (T, n) as the native CPU engine's integer kernels see it: each run of 32 values
    scaled by its largest magnitude / 127 and rounded to int8 (nearest, ties to even),
    then scaled back.  A block-quantized weight times that is exactly the kernels'
    integer dot product, up to float rounding; so a Model(act_q8=True) is the float
    reference of the native engine on quantized weights."""
    t, n = x.shape
    b = x.reshape(t, n // 32, 32)
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return (np.rint(b * inv) * d).reshape(t, n).astype(np.float32)


def rms_norm(x, weight, eps):
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(ms + np.float32(eps))) * weight


def rms_norm_c(x, weight, eps):
    """rms_norm computed as the native engine does (sum of squares in float64, one
    reciprocal, x * r * weight): the act_q8 reference uses it, because int8 rounding of
    the normed vector turns even a last-bit difference into a different code now and
    then (layer 0's input, a Q8_0 embedding row, lands on rounding boundaries often)."""
    ss = np.sum(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    r = (1.0 / np.sqrt(ss / x.shape[-1] + eps)).astype(np.float32)
    return x * r * weight


def silu(a):
    # sigmoid(a) = (1 + tanh(a/2)) / 2: no overflow for large |a|
    return a * (np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * a))


def rope_tables(head_dim, max_pos, theta):
    """cos, sin of shape (max_pos, head_dim/2): angle p * theta^(-2i/head_dim)."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x, cos, sin):
    """x (T, heads, head_dim), rotating the two halves of each head (the HF Llama layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def softmax(s):
    s = s - s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


# -- the model -------------------------------------------------------------------------------

def round_bf16(x):
    """x rounded to the nearest bfloat16 (ties to even; NaN stays NaN), kept as float32."""
    return (float32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32).reshape(np.shape(x))


class Model:
    """kv_bf16: round keys and values to bfloat16 as they enter the cache, as the GPU
    engine's bf16 cache does (the reference its tests compare against).  act_q8: the
    input of every product goes through fake_quant_q8 first, as the native CPU engine's
    kernels quantize it for block-quantized weights (its reference in the tests)."""

    def __init__(self, cfg, weights, lanes=None, max_seq=None, kv_bf16=False, act_q8=False):
        self.cfg, self.w = cfg, weights
        self.kv_bf16 = kv_bf16
        self.linear = (lambda x, w: linear(fake_quant_q8(x), w)) if act_q8 else linear
        self.norm = rms_norm_c if act_q8 else rms_norm
        self.lanes = lanes or OneLane()
        self.nh, self.nkv, self.hd = weights.n_heads, weights.n_kv_heads, cfg.head_dim
        self.max_seq = min(max_seq or cfg.max_position_embeddings, cfg.max_position_embeddings)
        # RoPE tables grow with the sequence (_rope): a checkpoint may claim a context of 2^31
        # tokens, and these are dense.
        self.cos = self.sin = np.zeros((0, self.hd // 2), np.float32)
        # np.zeros maps untouched pages lazily: a long context costs only what is used.
        shape = (cfg.num_hidden_layers, self.nkv, self.max_seq, self.hd)
        try:
            self.k_cache = np.zeros(shape, np.float32)
            self.v_cache = np.zeros(shape, np.float32)
        except (MemoryError, ValueError):
            gib = 2 * 4 * int(np.prod(shape, dtype=np.float64)) / 2**30
            raise KieError(f"a KV cache for a context of {self.max_seq} tokens ({gib:.3g} GiB of address space) "
                           f"cannot be allocated: ask for a shorter context (max_seq)") from None
        self.pos = 0

    def _rope(self, pos, T):
        """cos, sin of positions pos .. pos+T-1, the tables grown (doubling) on demand."""
        if pos + T > len(self.cos):
            n = min(self.max_seq, max(pos + T, 2 * len(self.cos), 256))
            self.cos, self.sin = rope_tables(self.hd, n, self.cfg.rope_theta)
        return self.cos[pos:pos + T], self.sin[pos:pos + T]

    def reset(self):
        self.pos = 0

    def close(self):
        """Nothing to free (numpy owns the arrays): the backend protocol's close."""

    def attention(self, li, lw, h, pos):
        T, nh, nkv, hd = h.shape[0], self.nh, self.nkv, self.hd
        qkv = self.linear(h, lw.wqkv)
        cos, sin = self._rope(pos, T)
        q = apply_rope(qkv[:, :nh * hd].reshape(T, nh, hd), cos, sin)
        k = apply_rope(qkv[:, nh * hd:(nh + nkv) * hd].reshape(T, nkv, hd), cos, sin)
        v = qkv[:, (nh + nkv) * hd:].reshape(T, nkv, hd)
        if self.kv_bf16:
            k, v = round_bf16(k), round_bf16(v)
        kc, vc = self.k_cache[li], self.v_cache[li]
        kc[:, pos:pos + T] = k.transpose(1, 0, 2)
        vc[:, pos:pos + T] = v.transpose(1, 0, 2)
        S, g = pos + T, nh // nkv
        # Query head j*g + i uses KV head j: group the queries per KV head.
        qg = q.reshape(T, nkv, g, hd).transpose(1, 2, 0, 3)              # (nkv, g, T, hd)
        scores = qg @ kc[:, None, :S].transpose(0, 1, 3, 2)               # (nkv, g, T, S)
        scores *= np.float32(1.0 / math.sqrt(hd))
        if T > 1:  # causal: token t sees keys up to pos + t
            future = np.arange(S)[None, :] > (pos + np.arange(T))[:, None]
            scores[..., future] = -np.inf
        out = softmax(scores) @ vc[:, None, :S]                           # (nkv, g, T, hd)
        return self.linear(out.transpose(2, 0, 1, 3).reshape(T, nh * hd), lw.wo)

    def mlp(self, lw, h):
        gu = self.linear(h, lw.w_gate_up)
        cols = gu.shape[1] // 2
        return self.linear(silu(gu[:, :cols]) * gu[:, cols:], lw.w_down)

    def forward(self, tokens, pos, all_logits=False):
        """Logits (T, vocab) or of the last token only (vocab,), for tokens at positions
        pos .. pos+T-1 (the KV cache must hold positions < pos)."""
        cfg, lanes, d = self.cfg, self.lanes, self.cfg.dtp_delay
        tokens = np.asarray(tokens, dtype=np.int64)
        if pos + len(tokens) > self.max_seq:
            raise PromptTooLongError(f"{pos + len(tokens)} tokens do not fit the context of {self.max_seq}")
        r = self.w.embed[tokens]
        pending = deque()
        for li, lw in enumerate(self.w.layers):
            for sub in (0, 1):
                # DTP: the residual r lacks the outputs of the last d sublayers, whose
                # sums are still in flight (d = 0: each sum is added before going on).
                norm = lw.attn_norm if sub == 0 else lw.mlp_norm
                h = self.norm(r, norm, cfg.rms_norm_eps)
                y = self.attention(li, lw, h, pos) if sub == 0 else self.mlp(lw, h)
                if d == 0:
                    r = r + lanes.sum(y)
                else:
                    pending.append(lanes.sum_start(y))
                    if len(pending) > d:
                        r = r + pending.popleft().wait()
        while pending:
            r = r + pending.popleft().wait()
        if not all_logits:
            r = r[-1:]
        logits = lanes.vocab(self.linear(self.norm(r, self.w.norm, cfg.rms_norm_eps), self.w.lm_head))
        logits = logits[:, :cfg.vocab_size]
        return logits if all_logits else logits[0]

    def prefill(self, tokens, chunk=256, all_logits=False):
        """Runs the prompt through the model in chunks of `chunk` tokens (which bounds the
        size of one sum and of the attention scores); returns the last token's logits
        (or every token's)."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if self.pos + len(tokens) > self.max_seq:
            raise PromptTooLongError(f"the prompt has {len(tokens)} tokens; the context holds {self.max_seq}"
                                     + (f" ({self.pos} already used)" if self.pos else ""))
        outs = []
        for i in range(0, len(tokens), chunk):
            part = tokens[i:i + chunk]
            outs.append(self.forward(part, self.pos, all_logits))
            self.pos += len(part)
        return np.concatenate(outs) if all_logits else outs[-1]

    def decode_step(self, token):
        """One token in, the next token's logits out: the function to profile."""
        logits = self.forward([token], self.pos)
        self.pos += 1
        return logits
