"""GpuModel: one lane of a model on one CUDA device, through the C engine
(csrc/, kie_gpu.h).  It offers the numpy Model's interface (reset, prefill,
decode_step returning logits, max_seq), which the tests and the host-side
sampler use, and a fast generate() in which the device picks every token and
the host only reads them from a ring, launching a few steps ahead.

Lanes (tensor parallelism) follow lanes/plan.py's plan exactly; their sums go through
a GPU kccl.Communicator, whose kccl.h functions the engine calls from its own
stream (also inside the captured graph), or, with the monokernel, through
KCCL's device API from inside the kernel.  The module links the libkccl.so that
the kccl package loads, so the engine and Python share the communicator."""
import re

import numpy as np

from .. import settings as _settings
from ..lanes.plan import lane_plan
from . import blas as _blas
from ..errors import (GpuArgumentError, GpuError, GpuMemoryError, GpuTimeoutError, GpuUnavailableError,
                      PromptTooLongError)
from ..formats.safetensors_io import float32_to_bf16_bits
from ..generate import Sampling, check_request, non_finite_logits
from ..lanes.native_engine import OwnsNativeEngine
from ..reference.model import rope_tables

try:
    from ._kie_gpu_cffi import ffi, lib
except ImportError as _e:  # an install that never built the module
    ffi = lib = None
    _IMPORT_ERROR = _e

MODE_ADVANCE, MODE_GREEDY, MODE_SAMPLE = 0, 1, 2
AHEAD = 4                 # decode steps in flight beyond the one being read
TOKEN_TIMEOUT_MS = 60000  # a step that takes this long means a lane is gone (KCCL times out first)

_ERRORS = {1: GpuArgumentError, 2: GpuError, 3: GpuMemoryError, 4: GpuError, 5: GpuError, 6: GpuTimeoutError,
           7: GpuUnavailableError, 8: GpuError}


def _check(rc):
    if rc:
        raise _ERRORS.get(rc, GpuError)(ffi.string(lib.kie_last_error()).decode(errors="replace"))


# The device checks each step's logits where it picks the token (pick.cu), so they never
# cross to the host; its report, in api.cu's words, becomes generate.py's error.
_NON_FINITE = re.compile(r"the logits of step \d+ are not finite")


def wait_token_checked(wait, step, source):
    """Runs wait() (a kie_wait_token call returning its rc) for generation step `step`:
    the device's non-finite-logits report raises generate.non_finite_logits (a
    NonFiniteLogitsError naming the checkpoint `source`), other failures their GpuError."""
    try:
        _check(wait())
    except GpuError as e:
        if _NON_FINITE.search(str(e)):
            raise non_finite_logits(source, step) from e
        raise


def gpu_built():
    """Whether this install compiled the engine's CUDA code."""
    return lib is not None and bool(lib.kie_built())


def cuda_build_plan():
    """What the build decided about the CUDA engine and why (kccl/_build_cuda.decide, as
    recorded in the module when it was compiled); None when the module is not built."""
    if lib is None:
        return None
    import json
    return json.loads(ffi.string(lib.kie_cuda_build_plan()).decode())


def device_count():
    if lib is None:
        return 0
    n = ffi.new("int *")
    lib.kie_device_count(n)
    return int(n[0])


def gpu_available():
    return gpu_built() and device_count() > 0


def require_gpu():
    """Raises GpuUnavailableError unless a GPU can be used; returns the device count."""
    if lib is None:
        raise GpuUnavailableError(f"the GPU engine's module is not built ({_IMPORT_ERROR}); reinstall the package")
    if not lib.kie_built():
        raise GpuUnavailableError(ffi.string(lib.kie_last_error()).decode())
    n = device_count()
    if n == 0:
        raise GpuUnavailableError("--device cuda: no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES, "
                                  "driver); use --device cpu")
    return n


def _kccl_handle(comm):
    """The kcclComm_t of a kccl.Communicator, as kie_create takes it."""
    from kccl import capi
    return ffi.cast("kcclComm_t", capi.handle(comm))


def native_function(name):
    """The address of kie_gpu.h function `name` in this module's engine, as an int (for
    native code calling it on a native_handle())."""
    if lib is None or not isinstance(name, str) or not name.startswith("kie_") or \
            not callable(getattr(lib, name, None)):
        raise GpuArgumentError(f"{name!r} is not a function of kie_gpu.h in this build")
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))


KERNELS = ("graph", "mono")


def kernel_code(name):
    """"graph" or "mono" -> KIE_KERNEL_*; anything else is a GpuArgumentError."""
    if name not in KERNELS:
        raise GpuArgumentError(f"kernel={name!r}: choose one of {', '.join(KERNELS)}")
    return lib.KIE_KERNEL_GRAPH if name == "graph" else lib.KIE_KERNEL_MONO


class GpuModel(OwnsNativeEngine):
    """cfg: the ModelConfig; comm: None (one lane) or a GPU kccl.Communicator whose
    ranks are the lanes; device: the CUDA device (default: the communicator's, else 0);
    pdl / prefetch: launch switches (default: PDL when this lane has its GPU to itself,
    prefetch 2: a GEMV's first loads before it waits for the previous kernel).  The
    GEMVs pipeline their loads and the o and down ones stage x in shared memory by default
    (the faster settings on the 2b shape: bench/RESULTS.md); tuning:
    {kie_shape field: value} for the kernel variants the benchmark compares
    (gemv_blocks_per_sm, gemv_u, gemv_pipe, gemv_x_l1, att_chunk, decode_attn, att_keys, att_split_keys, att_splits, att_heads,
    qkv_blocks_per_sm, o_blocks_per_sm, o_trigger_early, step_clock, l2_evict_first, mono_attn, mono_slots,
    gemv_early, gemv_carveout, att_warm, att_blocks, mono_sync, mono_ahead, gemv_residual,
    mono_residual, att_combine, mono_ll).  kernel: how a
    decode step runs, "graph" (a kernel per GEMV and attention, captured as a CUDA
    graph) or "mono" (one persistent kernel per step, the lanes' sums inside it);
    default KIE_GPU_KERNEL (kie_engine/settings.py holds it and every KIE_GPU_* setting).
    Lanes that share a GPU (more ranks than visible GPUs: MPS) split its SMs between
    their monokernels."""

    @staticmethod
    def _destroy(e):
        lib.kie_destroy(e)

    def __init__(self, cfg, comm=None, max_seq=None, device=None, pdl=None, prefetch=None, tuning=None,
                 kernel=None, prefill=None):
        ndev = require_gpu()
        size, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
        if comm is not None and size > 1 and comm.device is None:
            raise GpuArgumentError("the GPU engine's lanes need a GPU communicator (kccl.Communicator(device=...))")
        lp = lane_plan(cfg, rank, size)
        self.cfg, self.lane, self.size, self.rank = cfg, lp, size, rank
        self.max_seq = min(max_seq or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if device is None:
            device = comm.device if comm is not None and comm.device is not None else 0
        if not 0 <= device < ndev:
            raise GpuArgumentError(f"device={device}: this process sees {ndev} CUDA device(s)")
        shared = size > ndev  # lanes share a GPU (under MPS): waiting kernels must not hold its SMs
        s = ffi.new("kie_shape *")
        s.hidden, s.inter, s.layers = cfg.hidden_size, lp.c1 - lp.c0, cfg.num_hidden_layers
        s.heads, s.kv_heads, s.head_dim = lp.n_heads, lp.n_kv_heads, cfg.head_dim
        s.vocab, s.vocab_part, s.vocab_valid, s.vocab_off = cfg.vocab_size, lp.part, lp.v1 - lp.v0, lp.v0
        s.max_seq, s.eps, s.dtp_delay = self.max_seq, cfg.rms_norm_eps, cfg.dtp_delay
        s.tp_size, s.tp_rank = size, rank
        s.pdl = _settings.value("KIE_GPU_PDL", default=0 if shared else 1) if pdl is None else int(bool(pdl))
        s.prefetch = _settings.value("KIE_GPU_PREFETCH") if prefetch is None else int(prefetch)
        for field in ("gemv_blocks_per_sm", "gemv_u", "att_chunk", "gemv_pipe", "gemv_x_l1", "mono_prefetch",
                      "mono_blocks", "mono_attn", "mono_wait_ms", "decode_attn", "att_keys", "att_split_keys", "att_splits",
                      "att_heads", "l2_evict_first"):
            setattr(s, field, _settings.value("KIE_GPU_" + field.upper()))
        s.lanes_per_device = -(-size // ndev) if shared else 1
        s.kernel = kernel_code(kernel if kernel is not None else _settings.value("KIE_GPU_KERNEL"))
        self.prefill_note = self._prefill_mode(s, prefill)
        for k, v in (tuning or {}).items():
            setattr(s, k, int(v))
        self._shape = s
        kcomm = _kccl_handle(comm) if size > 1 else ffi.NULL
        self._comm = comm
        out = ffi.new("kie_engine **")
        _check(lib.kie_create(s, kcomm, device, out))
        self._e = out[0]
        self.device = device
        self._loaded = False
        self._logits = np.empty(cfg.vocab_size, np.float32)
        self.source = None  # the checkpoint, once load() has read one
        self.pos = 0
        cos, sin = rope_tables(cfg.head_dim, self.max_seq, cfg.rope_theta)
        self._upload_f32(lib.KIE_F_ROPE_COS, 0, cos)
        self._upload_f32(lib.KIE_F_ROPE_SIN, 0, sin)

    @staticmethod
    def _prefill_mode(s, prefill):
        """Sets the shape's prefill fields from `prefill` ("auto", "gemm", "gemv"; default
        KIE_GPU_PREFILL); returns what was chosen and why, in words."""
        mode = prefill if prefill is not None else _settings.value("KIE_GPU_PREFILL")
        if mode not in ("auto", "gemm", "gemv"):
            raise GpuArgumentError(f"prefill={mode!r}: choose one of auto, gemm, gemv")
        s.prefill_chunk = _settings.value("KIE_GPU_PREFILL_CHUNK")
        s.prefill_attn = _settings.value("KIE_GPU_PREFILL_ATTN")
        s.prefill_attn_keys = _settings.value("KIE_GPU_PREFILL_ATTN_KEYS")
        s.prefill_f32_sums = _settings.value("KIE_GPU_PREFILL_F32_SUMS")
        s.prefill = 0
        if mode == "gemv":
            return "gemv (asked for)"
        ok, where = _blas.load(lib, ffi)
        if ok:
            s.prefill = 1
            return f"gemm (cuBLAS: {where})"
        if mode == "gemm":
            raise GpuUnavailableError(f"prefill=gemm: {where}")
        return f"gemv ({where})"

    def set_sampling(self, sampling):
        """The pick of the steps that follow: MODE_GREEDY for temperature 0, else MODE_SAMPLE
        with the sampler set to `sampling`; returns the mode."""
        if sampling.temperature == 0:
            return MODE_GREEDY
        _check(lib.kie_set_sampling(self._handle(), sampling.temperature, sampling.top_k, sampling.top_p,
                                    sampling.seed & 0xFFFFFFFFFFFFFFFF))
        return MODE_SAMPLE

    def native_handle(self):
        """The engine's kie_engine * as an int, for native code that works on it through
        kie_gpu.h (bench/kie_native); GpuError once closed."""
        return int(ffi.cast("uintptr_t", self._handle()))

    # -- weights --------------------------------------------------------------------------
    def _handle(self):
        if self._e is None:
            raise GpuError("this GpuModel is closed")
        return self._e

    def _upload_f32(self, kind, layer, a):
        a = np.ascontiguousarray(a, np.float32)
        rows, cols = (1, a.shape[0]) if a.ndim == 1 else a.shape
        _check(lib.kie_upload(self._handle(), kind, layer, ffi.from_buffer(a), rows, cols, 0))

    def upload_matrix(self, kind, layer, m):
        """m: (out, in) float32 (rounded to bf16 here), uint16 bf16 bits, or a CUDA
        torch.bfloat16 tensor (copied device to device)."""
        if hasattr(m, "data_ptr") and getattr(m, "is_cuda", False):
            if str(m.dtype) != "torch.bfloat16" or m.dim() != 2 or not m.is_contiguous():
                raise GpuArgumentError(f"weight kind {kind}: a CUDA tensor must be contiguous 2-D bfloat16")
            # the engine copies on its own stream: what torch's stream still has to write must land first
            __import__("torch").cuda.current_stream(m.device).synchronize()
            _check(lib.kie_upload(self._handle(), kind, layer, ffi.cast("void *", m.data_ptr()), m.shape[0],
                                  m.shape[1], 1))
            return
        m = np.asarray(m)
        bits = m if m.dtype == np.uint16 else float32_to_bf16_bits(m)
        bits = np.ascontiguousarray(bits)
        _check(lib.kie_upload(self._handle(), kind, layer, ffi.from_buffer(bits), bits.shape[0], bits.shape[1], 0))

    def upload_vector(self, kind, layer, v):
        self._upload_f32(kind, layer, np.asarray(v, np.float32))

    def load(self, ckpt):
        """This lane's share of a checkpoint (anything with .config and
        .tensor(name, rows, cols) returning float32), in bf16 on the device."""
        cfg, lp = self.cfg, self.lane
        self.source = getattr(ckpt, "dir", None)  # named by a non-finite-logits error
        W = lib
        self.upload_matrix(W.KIE_W_EMBED, 0, ckpt.tensor("model.embed_tokens.weight"))
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            t = lambda n, rows=None, cols=None: ckpt.tensor(p + n, rows, cols)  # noqa: E731
            self.upload_matrix(W.KIE_W_QKV, i, np.concatenate([t("self_attn.q_proj.weight", lp.q_rows),
                                                               t("self_attn.k_proj.weight", lp.kv_rows),
                                                               t("self_attn.v_proj.weight", lp.kv_rows)]))
            self.upload_matrix(W.KIE_W_O, i, t("self_attn.o_proj.weight", cols=lp.q_rows))
            self.upload_matrix(W.KIE_W_GATE_UP, i, np.concatenate([t("mlp.gate_proj.weight", slice(lp.c0, lp.c1)),
                                                                   t("mlp.up_proj.weight", slice(lp.c0, lp.c1))]))
            self.upload_matrix(W.KIE_W_DOWN, i, t("mlp.down_proj.weight", cols=slice(lp.c0, lp.c1)))
            self.upload_vector(W.KIE_F_ATTN_NORM, i, t("input_layernorm.weight"))
            self.upload_vector(W.KIE_F_MLP_NORM, i, t("post_attention_layernorm.weight"))
        name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        head = ckpt.tensor(name, slice(lp.v0, lp.v1))
        if lp.v1 - lp.v0 < lp.part:
            head = np.concatenate([head, np.zeros((lp.part - (lp.v1 - lp.v0), cfg.hidden_size), np.float32)])
        self.upload_matrix(W.KIE_W_HEAD, 0, head)
        self.upload_vector(W.KIE_F_FINAL_NORM, 0, ckpt.tensor("model.norm.weight"))
        self._loaded = True
        return self

    # -- the numpy Model's interface ------------------------------------------------------
    def reset(self):
        _check(lib.kie_reset(self._handle()))
        self.pos = 0

    def _read_logits(self):
        _check(lib.kie_logits(self._handle(), ffi.from_buffer("float[]", self._logits), self._logits.size))
        return self._logits.copy()

    def prefill(self, tokens, chunk=None, all_logits=False):
        """Runs the prompt from the current position; returns the last token's logits."""
        if all_logits:
            raise GpuArgumentError("the GPU engine returns the last token's logits only")
        ids = np.ascontiguousarray(tokens, np.int32)
        if ids.size == 0:
            raise ValueError("prefill needs at least one token")
        if self.pos + ids.size > self.max_seq:
            raise PromptTooLongError(f"the prompt has {ids.size} tokens; the context holds {self.max_seq}"
                                     + (f" ({self.pos} already used)" if self.pos else ""))
        _check(lib.kie_prefill(self._handle(), ffi.from_buffer("int32_t[]", ids), int(ids.size), MODE_GREEDY))
        self.pos += int(ids.size)
        return self._read_logits()

    def first_token(self, prompt_ids, sampling=Sampling()):
        """From position 0: the prompt through the model and the first token picked on the
        device (what a request waits for before its first token; no logits cross to the
        host).  The position ends after the prompt."""
        ids = np.ascontiguousarray(prompt_ids, np.int32)
        if ids.size == 0:
            raise ValueError("the prompt has no tokens")
        check_request(int(ids.size), 1, self.max_seq)
        e = self._handle()
        mode = self.set_sampling(sampling)
        self.reset()
        tok = ffi.new("int32_t *")
        _check(lib.kie_prefill(e, ffi.from_buffer("int32_t[]", ids), int(ids.size), mode))
        wait_token_checked(lambda: lib.kie_wait_token(e, 0, TOKEN_TIMEOUT_MS, tok), 0, self.source)
        self.pos = int(ids.size)
        return int(tok[0])

    def decode_step(self, token):
        """One token in (through the captured graph), the next token's logits out."""
        if self.pos + 1 > self.max_seq:
            raise PromptTooLongError(f"the context of {self.max_seq} is full")
        e = self._handle()
        _check(lib.kie_set_token(e, int(token)))
        _check(lib.kie_decode(e, 1, MODE_GREEDY, 1))
        self.pos += 1
        return self._read_logits()

    # -- the fast path --------------------------------------------------------------------
    def generate(self, prompt_ids, max_new_tokens, sampling=Sampling(), eos_id=None, on_token=None,
                 use_graph=True, ahead=AHEAD):
        """generate.generate on this engine (the one decode loop), with its options:
        use_graph (replay the captured graph) and ahead (steps enqueued beyond the one
        being read)."""
        from ..generate import generate
        self._use_graph, self._ahead = use_graph, ahead
        try:
            return generate(self, prompt_ids, max_new_tokens, sampling, eos_id, on_token, source=self.source)
        finally:
            self._use_graph, self._ahead = True, AHEAD

    def tokens(self, prompt_ids, max_new_tokens, sampling=Sampling()):
        """The picked tokens, every one chosen on the device (generate.generate's source
        for this backend): the host enqueues decode steps up to `ahead` beyond the token it
        reads and only reads tokens from a ring.  Every lane enqueues the same number of
        steps whatever the timing (the count depends only on the tokens seen), so their
        sums always pair up; closing the iterator waits for the steps in flight."""
        use_graph, ahead = getattr(self, "_use_graph", True), getattr(self, "_ahead", AHEAD)
        prompt = np.ascontiguousarray(prompt_ids, np.int32)
        if prompt.size == 0:
            raise ValueError("the prompt has no tokens")
        check_request(int(prompt.size), max_new_tokens, self.max_seq)
        if not 1 <= ahead < lib.KIE_RING // 2:
            raise GpuArgumentError(f"ahead={ahead}: 1..{lib.KIE_RING // 2 - 1}")
        return self._tokens(prompt, max_new_tokens, sampling, use_graph, ahead)

    def _tokens(self, prompt, max_new_tokens, sampling, use_graph, ahead):
        e = self._handle()
        mode = self.set_sampling(sampling)
        self.reset()
        tok = ffi.new("int32_t *")
        try:
            _check(lib.kie_prefill(e, ffi.from_buffer("int32_t[]", prompt), int(prompt.size), mode))
            wait_token_checked(lambda: lib.kie_wait_token(e, 0, TOKEN_TIMEOUT_MS, tok), 0, self.source)
            self.pos = int(prompt.size)
            enqueued, got = 1, 0  # steps whose token is on its way (step 0 came from the prefill); tokens given
            while True:
                yield int(tok[0])
                got += 1
                if got >= max_new_tokens:
                    return
                want = min(max_new_tokens, got + ahead)
                if want > enqueued:
                    _check(lib.kie_decode(e, want - enqueued, mode, int(use_graph)))
                    self.pos += want - enqueued
                    enqueued = want
                wait_token_checked(lambda: lib.kie_wait_token(e, got, TOKEN_TIMEOUT_MS, tok), got, self.source)
        finally:
            _check(lib.kie_sync(e))

    # -- measurements ---------------------------------------------------------------------
    def info(self):
        i = ffi.new("kie_info *")
        _check(lib.kie_get_info(self._handle(), i))
        return {k: int(getattr(i, k)) for k in ("sms", "nsplit", "prefill_tokens", "gemv_blocks", "pos", "step",
                                                 "device_bytes", "graph_nodes", "kernel", "mono_slots",
                                                 "mono_slot_bytes", "mono_smem", "mono_stages", "mono_blocks",
                                                 "mono_reducers", "mono_att_keys", "mono_att_split_keys",
                                                 "mono_att_splits", "prefill_chunk", "mono_ll_stages")}

    def weight_bytes_per_token(self):
        """Bytes of bf16 weights one decode step streams on this lane."""
        cfg, lp = self.cfg, self.lane
        h, hd = cfg.hidden_size, cfg.head_dim
        q, kv, cols = lp.n_heads * hd, lp.n_kv_heads * hd, lp.c1 - lp.c0
        layer = (q + 2 * kv) * h + h * q + 2 * cols * h + h * cols
        return 2 * (cfg.num_hidden_layers * layer + lp.part * h)


def load_gpu_model(ckpt, comm=None, max_seq=None, **kw):
    """A GpuModel of the checkpoint on this rank's lane (the CLI's --device cuda)."""
    return GpuModel(ckpt.config, comm, max_seq=max_seq, **kw).load(ckpt)
