"""The server's seam to the engine: one model, loaded once, runs one request at a time.

run() is built on generate()'s on_token callback, so whichever decode loop generate.py
holds (numpy, native, CUDA) serves requests unchanged.  The callback may ask to stop
(a stop string, a client gone, shutdown); under tensor parallelism every lane calls it
at the same token, and the lanes agree on that answer before the next step, so all of
them leave the loop together."""
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from ..generate import Sampling, generate


class _StopAsked(Exception):
    """Raised inside the on_token callback to leave generate() at this token."""


@dataclass
class RunResult:
    tokens: List[int] = field(default_factory=list)
    reason: str = "length"     # "eos" (a stop id), "length" (max_tokens), "stopped" (on_token asked)
    prefill_s: float = 0.0     # request start to the first token
    total_s: float = 0.0


class EngineRunner:
    """model: a backend of backend.py (the numpy Model, the native CpuModel or GpuModel);
    link: a lanes.LaneLink under tensor parallelism (None for one process)."""

    def __init__(self, model, context, gpu=False, prefill_chunk=256, link=None, source=None):
        self.model, self.context, self.gpu = model, context, gpu
        self.prefill_chunk, self.link = prefill_chunk, link
        self.source = source  # the checkpoint, named by the engine's errors

    def run(self, prompt_ids, max_tokens, sampling: Sampling, stop_ids=None,
            on_token: Optional[Callable[[int], bool]] = None) -> RunResult:
        """Generates for one request; on_token(id) -> True stops after that token.  On
        the leading lane this first sends the request to the other lanes."""
        link = self.link
        if link is not None and link.leader:
            link.announce(prompt_ids, max_tokens, sampling, stop_ids)
        out = RunResult()
        t0 = time.perf_counter()

        def step(t):
            if not out.tokens:
                out.prefill_s = time.perf_counter() - t0
            out.tokens.append(t)
            failed = None
            try:
                stop = bool(on_token(t)) if on_token is not None else False
            except Exception as e:  # the other lanes still wait for this token's answer
                failed, stop = e, True
            if link is not None:
                stop = link.agree(stop)
            if failed is not None:
                raise failed
            if stop:
                raise _StopAsked

        try:
            if self.gpu:
                res = self.model.generate(prompt_ids, max_tokens, sampling, stop_ids, step)
            else:
                res = generate(self.model, prompt_ids, max_tokens, sampling, stop_ids, step, self.prefill_chunk,
                               source=self.source)
            out.reason = "eos" if res.stopped_on_eos else "length"
        except _StopAsked:
            out.reason = "stopped"
        out.total_s = time.perf_counter() - t0
        return out

    def close(self):
        if self.gpu:
            self.model.close()
