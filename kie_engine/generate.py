"""Sampling and the generation loop (every rank runs it; the same logits and the same
seeded generator give every rank the same tokens)."""
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

from .errors import NonFiniteLogitsError, PromptTooLongError


SEED_MAX = (1 << 64) - 1  # every engine's sampler takes a 64-bit seed (the GPU engine's is a uint64_t)


class SamplingError(ValueError):
    """A sampling parameter out of range; `param` names it (the CLI says --top-k where
    the API says top_k)."""

    def __init__(self, param, rule, value):
        super().__init__(f"{param} {rule}, got {value!r}")
        self.param, self.rule, self.value = param, rule, value


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    seed: int = 0              # 0..SEED_MAX, the same rule for the CLI and the HTTP API

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SamplingError("temperature", "must be >= 0", self.temperature)
        if self.top_k < 0:
            raise SamplingError("top_k", "must be >= 0", self.top_k)
        if not 0 < self.top_p <= 1:
            raise SamplingError("top_p", "must be in (0, 1]", self.top_p)
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or not 0 <= self.seed <= SEED_MAX:
            raise SamplingError("seed", f"must be an integer in 0..{SEED_MAX}", self.seed)


def sample(logits, s: Sampling, rng):
    if s.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    order = np.argsort(-z, kind="stable")
    if s.top_k:
        order = order[:s.top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if s.top_p < 1:  # the smallest prefix whose mass reaches top_p
        keep = int(np.searchsorted(np.cumsum(p), s.top_p)) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(order[rng.choice(len(order), p=p)])


@dataclass
class Result:
    tokens: List[int] = field(default_factory=list)
    prefill_s: float = 0.0     # prompt through the model, first token picked
    decode_s: float = 0.0      # every later token
    stopped_on_eos: bool = False

    @property
    def decode_tokens(self):
        return max(0, len(self.tokens) - 1)

    @property
    def tokens_per_s(self):
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    def summary(self):
        ms = 1e3 * self.decode_s / self.decode_tokens if self.decode_tokens else float("nan")
        return (f"prefill {1e3 * self.prefill_s:.1f} ms, decode {self.tokens_per_s:.2f} tokens/s "
                f"({ms:.2f} ms/token, {self.decode_tokens} tokens)")


def stop_set(eos_id):
    """The ids that end a generation: none, one id, or a collection (EOS and a chat
    template's end-of-turn)."""
    if eos_id is None:
        return set()
    if isinstance(eos_id, (int, np.integer)):
        return {int(eos_id)}
    return {int(i) for i in eos_id}


_CONTROL = {c: f"\\x{c:02x}" for c in list(range(32)) + [127] if chr(c) not in "\n\t"}


def printable(text):
    """text for a terminal: control characters other than newline and tab (which would
    move the cursor or erase what was written) as \\xNN escapes."""
    return text.translate(_CONTROL)


def check_request(n_prompt, max_new_tokens, context):
    """What generate() refuses, checkable before a model exists (the CLI checks first and
    prints after)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if n_prompt + max_new_tokens > context:
        raise PromptTooLongError(f"the prompt has {n_prompt} tokens and {max_new_tokens} more were asked "
                                 f"for; the context holds {context}")


def non_finite_logits(source, step, count=None):
    """The error for a step whose logits are not all finite (step 0: the prompt's)."""
    what = f"{count} of the logits" if count is not None else "the logits"
    return NonFiniteLogitsError(
        f"{source or 'the model'}: {what} of generation step {step} are NaN or infinite: the checkpoint's "
        f"weights are corrupt (or overflow float32); generation stopped")


def check_logits(logits, step, source=None):
    """Raises NonFiniteLogitsError naming `source` (the checkpoint's path) when a step's
    logits hold a NaN or an infinity: a corrupt weight makes NaN logits, whose argmax is
    token 0 (end of text here), so without this check the answer is silently empty.  A
    float64 sum is finite exactly when every logit is (float32 values cannot overflow
    it) and costs ~20 us on a 49k vocabulary, far below a step."""
    if not np.isfinite(np.add.reduce(logits, axis=None, dtype=np.float64)):
        raise non_finite_logits(source, step, int(np.count_nonzero(~np.isfinite(logits))))


def host_tokens(model, prompt_ids, sampling, prefill_chunk=256, source=None):
    """The picked tokens of a backend that returns logits (numpy, native CPU): the
    prompt's, then one per decode_step, each sampled here; an iterator that runs a step
    only when the next token is asked for."""
    rng = np.random.default_rng(sampling.seed)
    logits = model.prefill(prompt_ids, chunk=prefill_chunk)
    step = 0
    while True:
        check_logits(logits, step, source)
        tok = sample(logits, sampling, rng)
        yield tok
        step += 1
        logits = model.decode_step(tok)


def generate(model, prompt_ids, max_new_tokens, sampling=Sampling(), eos_id=None,
             on_token: Optional[Callable[[int], None]] = None, prefill_chunk=256, source=None):
    """Greedy or sampled generation from prompt_ids, at most max_new_tokens, stopping after
    eos_id (one id, or a collection of ids: EOS and a chat template's end-of-turn);
    on_token(id) is called as each token is produced.  Non-finite logits raise
    NonFiniteLogitsError naming `source` (the checkpoint).

    The one decode loop of every backend (backend.py): the tokens come from
    model.tokens(prompt_ids, max_new_tokens, sampling) when the backend picks them
    itself (the GPU engine), else from host_tokens over its logits."""
    prompt_ids = list(prompt_ids)
    stop = stop_set(eos_id)
    check_request(len(prompt_ids), max_new_tokens, model.max_seq)
    model.reset()
    out = Result()
    t0 = time.perf_counter()
    if hasattr(model, "tokens"):
        picked = model.tokens(prompt_ids, max_new_tokens, sampling)
    else:
        picked = host_tokens(model, prompt_ids, sampling, prefill_chunk, source)
    t1 = None
    try:
        for tok in picked:
            if t1 is None:
                out.prefill_s = time.perf_counter() - t0
                t1 = time.perf_counter()
            out.tokens.append(tok)
            if on_token:
                on_token(tok)
            if tok in stop:
                out.stopped_on_eos = True
                break
            if len(out.tokens) >= max_new_tokens:
                break
    finally:
        picked.close()  # a backend running ahead settles here (every lane stops at the same token)
    out.decode_s = time.perf_counter() - t1 if t1 is not None else 0.0
    return out
