"""`python -m kie_engine perplexity`: how well a model, run by one of KIE's engines,
predicts a text, and (--reference) how far that engine is from the float32 reference.

The first N tokens of the file (with BOS where the model's tokenizer adds one) go through
the engine in one teacher-forced pass: each position's logits score the next token.
perplexity = exp(mean over the N - 1 predictions of -log p(next token)).  Against the
reference (the numpy engine on the weights dequantized to float32, TP = 1) it also reports
the mean KL divergence KL(reference || engine) of the next-token distributions and the
share of positions whose most likely token is the same: llama.cpp's --kl-divergence
figures, so that rounding (KL near 0, agreement near 100 %) shows apart from a wrong kernel."""
import math
import os
from dataclasses import dataclass, field

import numpy as np

from .errors import KieError
from .generate import check_logits


def text_ids(tok, path, n):
    """The first n token ids of the text file at `path` (BOS first where the tokenizer adds
    one); ValueError when the file holds fewer."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"--tokens must be an integer >= 2 (one token to predict from, one to predict), got {n!r}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    ids = tok.encode(text).ids
    if len(ids) < n:
        raise ValueError(f"{path}: {len(ids)} tokens, fewer than --tokens {n}")
    return list(ids[:n])


def log_softmax(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclass
class Scores:
    """Running sums over scored positions."""
    nll: float = 0.0            # sum of -log p(next token)
    n: int = 0
    kl: float = 0.0             # sum of KL(reference || engine)
    same_top1: int = 0
    ref_nll: float = 0.0
    compared: int = 0
    per_token_kl: list = field(default_factory=list)

    def add(self, logp, target, ref_logp=None):
        self.nll -= float(logp[target])
        self.n += 1
        if ref_logp is not None:
            p = np.exp(ref_logp)
            kl = max(0.0, float(np.sum(p * (ref_logp - logp))))  # >= 0 but for the reference's float32 rounding
            self.kl += kl
            self.per_token_kl.append(kl)
            self.same_top1 += int(np.argmax(ref_logp) == np.argmax(logp))
            self.ref_nll -= float(ref_logp[target])
            self.compared += 1

    @property
    def perplexity(self):
        return math.exp(self.nll / self.n)

    def summary(self):
        out = {"tokens": self.n + 1, "scored": self.n, "perplexity": self.perplexity}
        if self.compared:
            out.update(reference_perplexity=math.exp(self.ref_nll / self.compared), kl_mean=self.kl / self.compared,
                       kl_max=max(self.per_token_kl), top1_agreement=self.same_top1 / self.compared)
        return out


def teacher_forced(model, ids, source=None):
    """The logits of positions 0 .. len(ids) - 2 (each predicts the next id), one at a
    time: the numpy engine's in one prefill of every position, the others step by step
    (which is what their prefill does)."""
    model.reset()
    if type(model).__name__ == "Model":  # the numpy engine computes every position's logits at once
        for i, logits in enumerate(model.prefill(ids[:-1], all_logits=True)):
            check_logits(logits, i, source)
            yield logits
        return
    logits = model.prefill(ids[:1])
    for i, t in enumerate(ids[1:-1] + [None]):
        check_logits(logits, i, source)
        yield logits
        if t is not None:
            logits = model.decode_step(t)


def reference_logprobs(ckpt, ids):
    """(len(ids) - 1, vocab) float32 log-probabilities of the float32 numpy reference (TP = 1)."""
    from .reference.sharded import load_model
    ref = load_model(ckpt, None, max_seq=len(ids))
    try:
        return np.stack([log_softmax(z).astype(np.float32) for z in teacher_forced(ref, ids, ckpt.dir)])
    finally:
        close = getattr(ref, "close", None)
        if close:
            close()


def score(model, ids, ref_logp=None, source=None):
    """Scores of `model` on ids (ref_logp: reference_logprobs of the same ids, or None)."""
    s = Scores()
    for i, logits in enumerate(teacher_forced(model, ids, source)):
        s.add(log_softmax(logits), ids[i + 1], None if ref_logp is None else ref_logp[i].astype(np.float64))
    return s


def report_lines(summary, reference):
    lines = [f"perplexity {summary['perplexity']:.4f} over {summary['scored']} tokens"]
    if reference:
        lines.append(f"against the float32 reference (perplexity {summary['reference_perplexity']:.4f}): "
                     f"KL divergence {summary['kl_mean']:.6f} mean, {summary['kl_max']:.6f} max; "
                     f"top-1 agreement {100 * summary['top1_agreement']:.2f} %")
    return lines


def describe_engine(model, kernel, size):
    """What ran, for the report: kernel and SIMD level, lanes."""
    what = kernel
    info = getattr(model, "info", None)
    if kernel == "native" and info:
        what = f"native ({info()['kernels']} kernels)"
    return what + (f", {size} lanes" if size > 1 else "")


def check_file(path):
    if not os.path.isfile(path):
        raise KieError(f"--file {path}: no such file")
    return path


__all__ = ["text_ids", "teacher_forced", "reference_logprobs", "score", "Scores", "report_lines", "log_softmax"]
