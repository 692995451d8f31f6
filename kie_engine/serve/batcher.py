"""Continuous batching, for an engine that runs several sequences per pass over its weights
(the native CPU engine: kie_engine/cpu/sequences.py).  One engine thread loops over
steps.  Before each step, waiting requests join (up to --max-batch, each with its own KV
cache, as long as the KV memory holds them) and cancelled ones leave; the step runs one
token of every decoding request and as much of the joining requests' prompts as the
engine's rows per pass leave room for; then every request whose step produced logits
samples its token (its own seeded generator, as alone), turns it into text and checks its
ends (end of text, max_tokens, a stop string).  A request that ends leaves at once, its
cache freed; the others go on.  A sequence's logits are the bits it would get alone, so
its greedy text does not depend on what else shares its steps.

A request fails alone: NaN logits (its own), a prompt past the context (refused before
it waits), a KV cache that cannot fit even with nothing else running.  A request whose
cache does not fit beside the running ones waits for them to leave."""
import sys
import time

import numpy as np

from ..errors import KvMemoryError, NonFiniteLogitsError
from ..generate import check_logits, sample
from .api_error import ApiError
from .scheduler import EngineQueue
from .text import TextStream


class _Running:
    """A request in the batch: its sequence, the prompt tokens not yet run, its generator."""

    def __init__(self, job, seq, tokenizer):
        self.job, self.seq = job, seq
        self.todo = list(job.prompt_ids)
        self.rng = np.random.default_rng(job.sampling.seed)
        self.text = TextStream(tokenizer, job.stops)
        self.tokens = []
        self.last = None
        self.kv_bytes = 0


# Microseconds the engine's threads poll for the next step before they sleep: the engine
# thread's own work between steps (sampling, text) and the HTTP side's need the cores.
IDLE_SPIN_US = 50


def _deliver(events):
    for job, event in events:
        job.events.put_nowait(event)


class BatchScheduler(EngineQueue):
    """The Scheduler's interface (submit, cancel, shutdown, join, start) over a model with
    new_sequence / free_sequence / run_rows and max_rows."""

    def __init__(self, model, tokenizer, metrics, max_batch, max_queue=32, source=None, on_fatal=None, kv_limit=0):
        self.model, self.tokenizer, self.kv_limit = model, tokenizer, kv_limit
        self.max_batch, self.source = max_batch, source
        self.active = []
        super().__init__(metrics, max_queue, on_fatal)
        metrics.kv_bytes = lambda: sum(r.kv_bytes for r in list(self.active))
        self.engine_sequences = 0  # the engine's own count, read on the engine thread after each change
        metrics.sequences = lambda: self.engine_sequences
        self.out = []  # a step's events, handed to the event loop together
        if hasattr(model, "set_idle_spin"):
            model.set_idle_spin(IDLE_SPIN_US)

    def running(self):
        return len(self.active)

    def _room(self):
        return max(0, self.max_batch - len(self.active))

    # -- the event loop's side -------------------------------------------------------------
    def submit(self, job):
        need = self.model.sequence_bytes(len(job.prompt_ids) + job.max_tokens)
        if self.kv_limit and need > self.kv_limit:
            raise ApiError(400, f"this request's KV cache ({need} bytes for {len(job.prompt_ids)} prompt tokens and "
                                f"{job.max_tokens} more) does not fit the server's KV memory ({self.kv_limit} bytes) "
                                f"even alone: ask for fewer tokens", param="max_tokens", code="kv_memory_exceeded")
        super().submit(job)

    # -- the engine thread -----------------------------------------------------------------
    def _work(self):
        try:
            while True:
                with self.cv:
                    while not self.waiting and not self.active and not self.closing:
                        self.cv.wait()
                    if self.closing and not self.active:
                        return
                    self._admit()
                    self._drop_cancelled()
                if self.active:
                    self._step()
                self._flush()
                if self.fatal is not None:
                    return
        finally:
            for r in list(self.active):  # a failure or shutdown left some: their caches go back too
                self._end(r, "shutdown")
            self._flush()

    def _admit(self):
        """Waiting requests join while there is room in the batch and the KV memory."""
        while self.waiting and len(self.active) < self.max_batch:
            job = self.waiting[0]
            try:
                seq = self.model.new_sequence(len(job.prompt_ids) + job.max_tokens)
            except KvMemoryError as e:
                if self.active:  # room comes back as running requests leave
                    return
                self.waiting.popleft()
                self.metrics.finish("error", 0, 0)
                job.post("error", ApiError(400, f"this request's KV cache does not fit the server's KV memory even "
                                                f"alone ({e}): ask for fewer tokens", param="max_tokens",
                                           code="kv_memory_exceeded"))
                continue
            self.waiting.popleft()
            self.engine_sequences = self.model.live_sequences()
            r = _Running(job, seq, self.tokenizer)
            r.kv_bytes = self.model.sequence_bytes(len(job.prompt_ids) + job.max_tokens)
            self.active.append(r)

    def _drop_cancelled(self):
        for r in [r for r in self.active if r.job.cancelled]:
            self._end(r, "cancelled")

    def _rows(self):
        """This step's rows: a token of every decoding request, then prompt tokens of the
        joining ones in arrival order, up to the engine's rows per pass.  (seqs, tokens,
        want, the requests whose logits come back, in row order)."""
        seqs, toks, want, owners = [], [], [], []
        for r in self.active:
            if not r.todo:
                seqs.append(r.seq)
                toks.append(r.tokens[-1])
                want.append(1)
                owners.append(r)
        room = self.model.max_rows - len(seqs)
        for r in self.active:
            if not r.todo or room <= 0:
                continue
            take = min(room, len(r.todo))
            seqs += [r.seq] * take
            toks += r.todo[:take]
            want += [0] * (take - 1) + [int(take == len(r.todo))]
            if take == len(r.todo):
                owners.append(r)
            del r.todo[:take]
            room -= take
        return seqs, toks, want, owners

    def _step(self):
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            for r in list(self.active):
                self._end(r, "shutdown")
            return
        seqs, toks, want, owners = self._rows()
        try:
            logits, _bad = self.model.run_rows(seqs, toks, want)
        except Exception as e:  # the engine failed: every request of the step fails
            print(f"kie serve: a batch step failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            for r in list(self.active):
                self._end(r, "error", ApiError(500, f"the engine failed on this request: {type(e).__name__}: {e}",
                                               type="server_error", code="engine_error"))
            self._engine_failed(e)
            return
        self.metrics.batch_step(len(set(seqs)), len(seqs))
        # every logit of a row is finite exactly when the one argmax picks (the first NaN
        # if there is one) and the smallest are: generate.check_logits's question per row,
        # in two passes over the logits (a float64 sum took three times as long)
        greedy = np.argmax(logits, axis=1)
        finite = np.isfinite(logits[np.arange(len(greedy)), greedy]) & np.isfinite(logits.min(axis=1))
        for i, r in enumerate(owners):
            self._emit(r, logits[i], bool(finite[i]), int(greedy[i]))

    def _post(self, job, *event):
        """Job.post, gathered: the step's events reach the event loop in one call."""
        if event[0] in ("done", "error"):
            job.ended = True
        self.out.append((job, event))

    def _flush(self):
        out, self.out = self.out, []
        if not out:
            return

        by_loop = {}
        for job, event in out:
            by_loop.setdefault(job.loop, []).append((job, event))
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _emit(self, r, logits, finite, greedy):
        job, now = r.job, time.perf_counter()
        if not finite:
            try:
                check_logits(logits, len(r.tokens), self.source)
            except NonFiniteLogitsError as e:
                print(f"kie serve: a request failed: {e}", file=sys.stderr, flush=True)
                self._end(r, "error", ApiError(500, f"the engine failed on this request: NonFiniteLogitsError: {e}",
                                               type="server_error", code="engine_error"))
                return
        tok = greedy if job.sampling.temperature == 0 else sample(logits, job.sampling, r.rng)
        if r.last is None:
            self.metrics.first_token(now - job.arrived)
        else:
            self.metrics.next_token(now - r.last)
        r.last = now
        r.tokens.append(tok)
        piece = r.text.push(tok)
        if piece:
            self._post(job, "text", piece)
        if r.text.hit:
            self._end(r, "stop")
        elif job.stop_ids is not None and tok in job.stop_ids:
            self._end(r, "stop", rest=True)
        elif len(r.tokens) >= job.max_tokens:
            self._end(r, "length", rest=True)

    def _end(self, r, reason, error=None, rest=False):
        """r leaves the batch (its cache freed) with its last events."""
        if r in self.active:
            self.active.remove(r)
        try:
            self.model.free_sequence(r.seq)
            self.engine_sequences = self.model.live_sequences()
        except Exception as e:  # a closed engine at shutdown: nothing left to free
            print(f"kie serve: freeing a sequence: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        job, n = r.job, len(r.tokens)
        if rest:
            tail = r.text.finish()
            if tail:
                self._post(job, "text", tail)
        self.metrics.finish(reason, len(job.prompt_ids), n)
        if error is not None:
            self._post(job, "error", error)
        elif reason == "shutdown":
            self._post(job, "error", ApiError(503, f"the server is shutting down: the generation was cut after {n} "
                                                   f"tokens", type="server_error", code="server_shutdown"))
        else:
            self._post(job, "done", reason, n)
