"""Several sequences in one native CPU engine (csrc/kie_cpu.h's kie_cpu_seq_* and
kie_cpu_batch): each its own KV cache and position, and any rows of any of them (a
prompt's chunk, one decode step of many) run in one pass over the weights.  A row gets
the bits it would get alone, token by token: a sequence's tokens do not depend on what
else shares its steps.  CpuModel takes these methods."""
import numpy as np

from ..errors import CpuEngineError, KvMemoryError

from ._native import ffi, lib


def _ptr(a):
    return ffi.cast("void *", a.__array_interface__["data"][0])


class Sequences:
    """Needs self._handle(), self._check(rc), self.cfg, self.lane, self.size and
    self.max_rows (rows per pass)."""

    def new_sequence(self, positions):
        """A new sequence with room for `positions` tokens; its id.  KvMemoryError when its
        cache would pass the engine's kv_limit (with the live sequences' caches)."""
        out = ffi.new("int *")
        rc = lib.kie_cpu_seq_new(self._handle(), int(positions), out)
        if rc == lib.KIE_CPU_E_MEMORY:
            raise KvMemoryError(ffi.string(lib.kie_cpu_last_error()).decode(errors="replace"))
        self._check(rc)
        return out[0]

    def free_sequence(self, seq):
        self._check(lib.kie_cpu_seq_free(self._handle(), int(seq)))

    def sequence_pos(self, seq):
        """Tokens in sequence seq's cache, or -1 when it does not exist."""
        return int(lib.kie_cpu_seq_pos(self._handle(), int(seq)))

    def live_sequences(self):
        """How many sequences new_sequence made are live (not freed)."""
        return int(lib.kie_cpu_seq_count(self._handle()))

    def sequence_bytes(self, positions):
        """KV cache bytes of a sequence with room for `positions` tokens."""
        return int(lib.kie_cpu_seq_bytes(self._handle(), int(positions)))

    def run_rows(self, seqs, tokens, want=None):
        """One pass over the weights for rows (seqs[i], tokens[i]), at most max_rows: each
        sequence's rows take its next positions in order.  Returns (logits of the rows
        with want[i], in row order, as (n_want, vocab) float32; bad: per row, True when its
        sequence met a NaN or an infinity, whose logits are NaN)."""
        seqs = np.ascontiguousarray(seqs, np.int32)
        tokens = np.ascontiguousarray(tokens, np.int32)
        n = int(seqs.size)
        if tokens.size != n:
            raise ValueError(f"{n} sequence ids for {tokens.size} tokens")
        want = np.ones(n, np.uint8) if want is None else np.ascontiguousarray(want, np.uint8)
        k = int(np.count_nonzero(want))
        logits = np.empty((max(k, 1), self.lane.part * self.size), np.float32)
        bad = np.zeros(n, np.int32)
        self._check(lib.kie_cpu_batch(self._handle(), ffi.cast("int32_t *", _ptr(seqs)),
                                      ffi.cast("int32_t *", _ptr(tokens)), n, ffi.cast("uint8_t *", _ptr(want)),
                                      ffi.cast("float *", _ptr(logits)), ffi.cast("int32_t *", _ptr(bad))))
        return logits[:k, :self.cfg.vocab_size], bad.astype(bool)

    def prefill_sequence(self, seq, tokens, chunk=None):
        """The prompt's tokens into sequence seq, `chunk` rows per pass (default and at
        most max_rows); the last token's logits."""
        ids = np.asarray(list(tokens), np.int32)
        if ids.size == 0:
            raise ValueError("prefill needs at least one token")
        room = self.sequence_pos(seq)
        if room < 0:
            raise CpuEngineError(f"sequence {seq} does not exist")
        c = max(1, min(int(chunk or self.max_rows), self.max_rows))
        last = None
        for i in range(0, ids.size, c):
            part = ids[i:i + c]
            want = np.zeros(part.size, np.uint8)
            want[-1] = i + c >= ids.size
            logits, _ = self.run_rows(np.full(part.size, seq, np.int32), part, want)
            if want[-1]:
                last = logits[0]
        return last.copy()

    def decode_rows(self, seqs, tokens):
        """One token for each of several distinct sequences; (logits (n, vocab), bad)."""
        return self.run_rows(seqs, tokens)

