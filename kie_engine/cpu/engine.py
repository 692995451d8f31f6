"""CpuModel: one lane of a model on the CPU through the native decode step
(csrc/kie_cpu.h), with the numpy Model's interface (reset, prefill, decode_step
returning logits, max_seq, close), so that generate.generate drives it as it drives
the reference.

Weights stay in their stored block format (GGUF: F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q4_K, Q6_K as the kernels take them; safetensors: F32, F16, BF16): each lane's matrices
are copied once into one buffer of anonymous memory (see _load), Q8_0, Q4_0 and Q4_1
reordered on the way into the kernels' sixteen-row packed layout (csrc/kq.h), which streams
from memory ~3x faster than the GGUF rows.
GGUF files keep llama.cpp's Q/K row order, so RoPE rotates adjacent pairs there
(KIE_CPU_ROPE_PAIRS) and halves for safetensors; attention scores do not depend on
the order as long as queries and keys share it.

Lanes follow lanes.plan's lane_plan, or its head_split_plan where the KV groups do not split evenly
(SmolLM2's 9 query heads on 2 lanes: 5 + 4, KV group 1 on both, 768 + 768 MLP columns),
so that each sublayer is about even: the lanes meet at every sum.  Their sums go
through KCCL's host all-reduce, called from C by the step itself (split phase: a lane
prefetches its next weights while the sum is not in)."""
import os

import numpy as np

from ..errors import CpuEngineError, KieError, PromptTooLongError, ShardingError, UnsupportedFormatError
from ..formats.gguf_types import CODES as TYPE_CODES, FLOATS, NAMES
from ..lanes.native_engine import OwnsNativeEngine
from ..lanes.plan import head_split_plan, lane_plan

from ._native import ffi, lib, native
from .sequences import Sequences

# GGUF's types (gguf_types.TYPE_CODES); the kernels say which they take (kq_supported)
_SAFETENSORS_TYPES = {NAMES[c]: c for c in FLOATS}
KV_TYPES = ("f16", "f32")


def require_native():
    """CpuNotBuiltError (a KieError) when the extension is missing."""
    native()


def supported_types():
    require_native()
    return [n for n, c in TYPE_CODES.items() if lib.kq_supported(c)]


def _check(rc):
    if rc:
        text = ffi.string(lib.kie_cpu_last_error()).decode(errors="replace")
        if rc == lib.KIE_CPU_E_TYPE:
            raise UnsupportedFormatError(text)
        if rc == lib.KIE_CPU_E_MEMORY:
            raise MemoryError(text)
        if rc == lib.KIE_CPU_E_STATE and "context" in text:
            raise PromptTooLongError(text)
        raise CpuEngineError(text)


def _ptr(a):
    return ffi.cast("void *", a.__array_interface__["data"][0])


class _Weights:
    """A checkpoint's matrices as (type code, rows x row-bytes uint8 array) in their stored
    format, and its vectors as float32."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.gguf = hasattr(ckpt, "raw_tensor")
        self.where = getattr(ckpt, "path", getattr(ckpt, "dir", "?"))
        self.touched = []  # (address, bytes) of the file's mapping that matrix() handed out

    def _raw(self, name):
        """(type code, type name, rows, cols, (rows, row bytes) uint8 view)."""
        if self.gguf:
            # the stored row order: this engine rotates adjacent pairs, as llama.cpp does
            raw, t, cols = self.ckpt.raw_tensor(name, hf_order=False)
            tname = _type_name(t)
            self._supported(name, t, tname)
            return t, tname, raw.shape[0], cols, raw
        a, dt = self.ckpt.stored(name)
        if dt not in _SAFETENSORS_TYPES:
            raise UnsupportedFormatError(f"{self.where}: tensor {name!r} has dtype {dt}; the CPU engine takes "
                                         f"{', '.join(_SAFETENSORS_TYPES)}")
        rows, cols = a.shape
        return _SAFETENSORS_TYPES[dt], dt, rows, cols, a.view(np.uint8).reshape(rows, -1)

    def _supported(self, name, t, tname):
        if not lib.kq_supported(t):
            raise UnsupportedFormatError(f"{self.where}: tensor {name!r} has type {tname}, which the CPU engine's "
                                         f"kernels do not take (supported: {', '.join(supported_types())}); "
                                         f"use --kernel numpy or re-quantize the model")

    def release(self):
        """Lets go of the file's pages that matrix() read (madvise MADV_DONTNEED on the
        mapping: the page cache keeps them; this process stops counting them)."""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = os.sysconf("SC_PAGE_SIZE")
        for addr, n in self.touched:
            a0, a1 = addr // page * page, -(-(addr + n) // page) * page
            libc.madvise(a0, a1 - a0, 4)  # MADV_DONTNEED; a failure only leaves pages counted
        self.touched = []

    def matrix(self, name, rows=None, cols=None, pad_rows=0, track=True):
        """(type, rows, cols, contiguous uint8 array) of tensor[rows, cols]: a view of the
        map for a row range, a copy for a column range (whole blocks; a range that cuts
        blocks is dequantized to F32); pad_rows zero rows appended (a zero block is zero
        in every format)."""
        t, tname, n_rows, n_cols, raw = self._raw(name)
        if track and not raw.flags.owndata:  # a view of the file's mapping
            self.touched.append((raw.__array_interface__["data"][0], raw.nbytes))
        if rows is not None:
            raw = raw[rows]
        if cols is not None and (cols.start or 0, cols.stop if cols.stop is not None else n_cols) != (0, n_cols):
            c0, c1 = cols.start or 0, cols.stop if cols.stop is not None else n_cols
            blk = int(lib.kq_block_elems(t))
            if c0 % blk == 0 and (c1 % blk == 0 or c1 == n_cols):
                bpb = int(lib.kq_row_bytes(t, blk))
                raw = np.ascontiguousarray(raw[:, c0 // blk * bpb:-(-c1 // blk) * bpb])
            else:
                f = np.empty((raw.shape[0], n_cols), np.float32)
                for r in range(raw.shape[0]):
                    lib.kq_dequant_row(t, _ptr(raw[r]), n_cols, ffi.cast("float *", _ptr(f[r])))
                t, raw = TYPE_CODES["F32"], np.ascontiguousarray(f[:, c0:c1]).view(np.uint8)
            n_cols = c1 - c0
        if pad_rows:
            raw = np.concatenate([raw, np.zeros((pad_rows, raw.shape[1]), np.uint8)])
        if not raw.flags.c_contiguous:
            raw = np.ascontiguousarray(raw)
        return t, raw.shape[0], n_cols, raw

    def vector(self, name):
        return np.ascontiguousarray(self.ckpt.tensor(name), np.float32)


def _type_name(t):
    for n, c in TYPE_CODES.items():
        if c == t:
            return n
    try:
        import gguf
        return gguf.GGMLQuantizationType(t).name
    except (ImportError, ValueError):
        return f"type id {t}"


def default_cpus(threads, rank=0, node_cpu_sets=None):
    """CPUs to pin the pool's threads to: this rank's own CPUs when no other rank shares
    them, else its slice of the shared set (rank-th group of `threads`); None (no
    pinning) when there are not enough CPUs for every thread of every sharing rank."""
    mine = sorted(os.sched_getaffinity(0))
    everyone = node_cpu_sets if node_cpu_sets is not None else [mine]
    sharing = [i for i, c in enumerate(everyone) if set(c) & set(mine)]
    slot = sharing.index(rank) if rank in sharing and len(sharing) == len(everyone) else 0
    if len(sharing) <= 1:
        slot = 0
    first = slot * threads
    if first + threads > len(mine):
        return None
    return mine[first:first + threads]


class CpuModel(Sequences, OwnsNativeEngine):
    """cfg from ckpt; comm: None (one lane) or a host kccl.Communicator whose ranks are the
    lanes (made with lanes.plan.comm_config(cfg)); threads: the pool's size (default
    threads.choose()); kv: the KV cache's element type, "f16" (default) or "f32";
    cpus: CPUs to pin the pool's worker threads to (default default_cpus; [] or False:
    no pinning); node_cpu_sets: the CPU sets of every rank on this machine (default: gathered
    through comm, so that lanes neither oversubscribe nor pin to the same CPUs); max_rows:
    rows per pass over the weights (a prompt's chunk, a batch of sequences: sequences.py);
    kv_limit: bytes of KV cache the sequences made by new_sequence may hold together
    (0: no limit but the machine's)."""

    _check = staticmethod(_check)

    @staticmethod
    def _destroy(e):
        lib.kie_cpu_destroy(e)

    def __init__(self, ckpt, comm=None, max_seq=None, threads=None, kv="f16", cpus=None, node_cpu_sets=None,
                 pack=True, max_rows=64, kv_limit=0):
        require_native()
        from ..lanes.threads import choose
        cfg = ckpt.config
        size, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
        if kv not in KV_TYPES:
            raise KieError(f"kv={kv!r}: choose one of {', '.join(KV_TYPES)}")
        w = _Weights(ckpt)
        align = 1
        if size > 1:  # a lane's MLP columns must be whole blocks of the down projection
            t = w._raw("model.layers.0.mlp.down_proj.weight")[0]
            align = int(lib.kq_block_elems(t))
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_group = q_first = 0
        if 1 < size <= nh and nkv % size:  # KV groups do not split evenly: split the query heads
            lp = head_split_plan(cfg, size, align)[rank]
            q_group = nh // nkv
            q_first = lp.q_rows.start // hd - lp.kv_rows.start // hd * q_group
        else:
            lp = lane_plan(cfg, rank, size, uneven=True, align=align)
        self.cfg, self.lane, self.size, self.rank = cfg, lp, size, rank
        self.max_seq = min(max_seq or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if node_cpu_sets is None and size > 1:  # lanes made by a library caller: ask them
            from ..lanes.threads import cpu_sets_through
            node_cpu_sets = cpu_sets_through(comm)
        n = int(threads) if threads is not None else choose(None, node_cpu_sets)[0]
        if cpus is None:
            cpus = default_cpus(n, rank, node_cpu_sets)
        s = ffi.new("kie_cpu_shape *")
        s.hidden, s.inter, s.layers = cfg.hidden_size, lp.c1 - lp.c0, cfg.num_hidden_layers
        s.heads, s.kv_heads, s.head_dim = lp.n_heads, lp.n_kv_heads, cfg.head_dim
        s.vocab_part, s.max_seq, s.eps, s.rope_theta = lp.part, self.max_seq, cfg.rms_norm_eps, cfg.rope_theta
        s.rope_mode = lib.KIE_CPU_ROPE_PAIRS if w.gguf else lib.KIE_CPU_ROPE_HALVES
        s.kv_type = lib.KIE_CPU_KV_F16 if kv == "f16" else lib.KIE_CPU_KV_F32
        s.dtp_delay, s.tp_size, s.tp_rank, s.threads = cfg.dtp_delay, size, rank, n
        s.q_group, s.q_first = q_group, q_first
        s.max_rows, s.kv_limit = int(max_rows), int(kv_limit)
        self.max_rows = int(max_rows)
        cpu_arr = ffi.new("int[]", list(cpus)) if cpus else ffi.NULL
        s.cpus = cpu_arr
        c = ffi.NULL
        if size > 1:
            import kccl.capi as capi
            c = ffi.cast("kcclComm_t", capi.handle(comm))
        out = ffi.new("kie_cpu **")
        _check(lib.kie_cpu_create(s, c, out))
        self._e, self._comm, self.threads, self.cpus, self.kv = out[0], comm, n, list(cpus or []), kv
        self._keep = []
        self.packed = bool(pack)
        try:
            self._load(w, lp)
        except BaseException:
            self.close()
            raise
        self._logits = np.empty(lp.part * size, np.float32)
        self._logits_ptr = ffi.cast("float *", _ptr(self._logits))
        self.pos = 0

    def _mat(self, m, arrays):
        t, rows, cols, raw = arrays
        self._keep.append(raw)
        m.data, m.type, m.rows, m.cols = _ptr(raw), t, rows, cols

    def _vec(self, a):
        self._keep.append(a)
        return ffi.cast("float *", _ptr(a))

    def _load(self, w, lp):
        """Every matrix of this lane copied into one buffer of anonymous memory (numpy asks
        the kernel for huge pages at this size), then the file's pages let go: streaming
        the weights from the file's mapping ran ~8x slower here (its 4 kB page-cache pages
        against 2 MB pages: bench/RESULTS.md), and letting go keeps the process at about
        one copy of the weights.  The embedding table is read a row per token: it stays in
        the mapping, unless the LM head's copy already holds it (tied, one lane)."""
        cfg = self.cfg
        todo, layers = [], []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            L = ffi.new("kie_cpu_layer *")
            cs = slice(lp.c0, lp.c1)
            todo += [(L.q, w.matrix(p + "self_attn.q_proj.weight", lp.q_rows)),
                     (L.k, w.matrix(p + "self_attn.k_proj.weight", lp.kv_rows)),
                     (L.v, w.matrix(p + "self_attn.v_proj.weight", lp.kv_rows)),
                     (L.o, w.matrix(p + "self_attn.o_proj.weight", cols=lp.q_rows)),
                     (L.gate, w.matrix(p + "mlp.gate_proj.weight", cs)),
                     (L.up, w.matrix(p + "mlp.up_proj.weight", cs)),
                     (L.down, w.matrix(p + "mlp.down_proj.weight", cols=cs))]
            L.attn_norm = self._vec(w.vector(p + "input_layernorm.weight"))
            L.mlp_norm = self._vec(w.vector(p + "post_attention_layernorm.weight"))
            layers.append(L)
        embed, head = ffi.new("kie_cpu_mat *"), ffi.new("kie_cpu_mat *")
        name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        todo.append((head, w.matrix(name, slice(lp.v0, lp.v1), pad_rows=lp.part - (lp.v1 - lp.v0))))
        # Q8_0 / Q4_0 / Q4_1 go into the kernels' sixteen-row packed layout (kq.h), the rest as stored
        packed = [int(lib.kq_packed_bytes(a[0], a[1], a[2])) if self.packed else 0 for _m, a in todo]
        sizes = [((p or a[3].nbytes) + 63) // 64 * 64 for p, (_m, a) in zip(packed, todo)]
        pack = np.empty(sum(sizes) + 64, np.uint8)
        off = (-pack.__array_interface__["data"][0]) % 64
        for (m, (t, rows, cols, raw)), n, p in zip(todo, sizes, packed):
            if p:
                t = lib.kq_pack(t, _ptr(raw), rows, cols, _ptr(pack[off:off + p]))
            else:
                np.copyto(pack[off:off + raw.nbytes].reshape(raw.shape), raw)
            m.data, m.type, m.rows, m.cols = _ptr(pack[off:]), t, rows, cols
            off += n
        self._keep.append(pack)
        self.pack_bytes = pack.nbytes
        w.release()
        if cfg.tie_word_embeddings and self.size == 1 and not head.type & lib.KQ_PACKED:
            embed.data, embed.type, embed.rows, embed.cols = head.data, head.type, head.rows, head.cols
        else:
            self._mat(embed, w.matrix("model.embed_tokens.weight", track=False))
        for i, L in enumerate(layers):
            _check(lib.kie_cpu_set_layer(self._e, i, L))
        _check(lib.kie_cpu_set_globals(self._e, embed, self._vec(w.vector("model.norm.weight")), head))

    # -- the numpy Model's interface ------------------------------------------------------
    def _handle(self):
        if self._e is None:
            raise CpuEngineError("this CpuModel is closed")
        return self._e

    def reset(self):
        _check(lib.kie_cpu_reset(self._handle()))
        self.pos = 0

    def _run(self, ids):
        ids = np.ascontiguousarray(ids, np.int32)
        _check(lib.kie_cpu_run(self._handle(), ffi.cast("int32_t *", _ptr(ids)), int(ids.size), self._logits_ptr))
        self.pos += int(ids.size)
        return self._logits[:self.cfg.vocab_size].copy()

    def prefill(self, tokens, chunk=None, all_logits=False):
        """Runs the prompt from the current position, `chunk` tokens per pass over the
        weights (default and at most max_rows; 1: the token step, one pass per token, as
        decode_step runs); returns the last token's logits, the same bits either way."""
        if all_logits:
            raise KieError("the native CPU engine returns the last token's logits only")
        ids = np.asarray(list(tokens), np.int64)
        if ids.size == 0:
            raise ValueError("prefill needs at least one token")
        if self.pos + ids.size > self.max_seq:
            raise PromptTooLongError(f"the prompt has {ids.size} tokens; the context holds {self.max_seq}"
                                     + (f" ({self.pos} already used)" if self.pos else ""))
        if chunk == 1:
            return self._run(ids)
        logits = self.prefill_sequence(0, ids, chunk)
        self.pos += int(ids.size)
        return logits

    def decode_step(self, token):
        if self.pos + 1 > self.max_seq:
            raise PromptTooLongError(f"the context of {self.max_seq} is full")
        return self._run([token])

    # -- measurements ---------------------------------------------------------------------
    def info(self):
        i = ffi.new("kie_cpu_info *")
        _check(lib.kie_cpu_get_info(self._handle(), i))
        return {"threads": i.threads, "pos": i.pos, "kv_bytes": int(i.kv_bytes), "work_bytes": int(i.work_bytes),
                "weight_bytes": int(i.weight_bytes), "kernels": ffi.string(i.kernels).decode(),
                "attn_simd": bool(i.attn_simd), "cpus": self.cpus, "kv": self.kv}

    STAGES = ("norm+qkv", "attention", "o", "gate_up", "down", "sums", "head", "rest")

    def set_idle_spin(self, us):
        """Microseconds the pool's threads poll for the next step before they sleep (default
        2000; the server sets less: its own work between steps needs the cores)."""
        _check(lib.kie_cpu_set_idle_spin(self._handle(), int(us)))

    def set_profiling(self, on):
        _check(lib.kie_cpu_set_profiling(self._handle(), int(bool(on))))

    def profile(self):
        """{stage: seconds per step} since the last call (profiling on), and "steps"."""
        sec = ffi.new("double[]", len(self.STAGES))
        steps = ffi.new("int *")
        _check(lib.kie_cpu_profile(self._handle(), sec, len(self.STAGES), steps))
        n = max(1, steps[0])
        out = {k: sec[i] / n for i, k in enumerate(self.STAGES)}
        out["steps"] = steps[0]
        return out


def load_cpu_model(ckpt, comm=None, max_seq=None, **kw):
    """A CpuModel of the checkpoint on this rank's lane (the CLI's default --device cpu)."""
    return CpuModel(ckpt, comm, max_seq=max_seq, **kw)


__all__ = ["CpuModel", "load_cpu_model", "supported_types", "require_native", "default_cpus", "ShardingError"]
