"""`python -m kie_engine init`: a randomly initialised Laneformer checkpoint in the
Hugging Face Llama format (config.json, model.safetensors, tokenizer.json), so that
everything runs offline.

The weights are generated a block of rows at a time and written as they are made, so
memory stays at a few blocks whatever the model's size (the 2b preset is 7.6 GB of
float32 before it is rounded to bfloat16)."""
import json
import os
import sys
import time

import numpy as np

from ..errors import ConfigError, KieError
from .checkpoint import expected_shapes
from .config import BYTE_VOCAB
from .safetensors_io import float32_to_bf16_bits, write_stream
from .tokenizer import byte_level_tokenizer

BLOCK_BYTES = 16 << 20  # float32 bytes generated at once


def _blocks(cfg, seed):
    """(name, float32 block) in checkpoint order: matrices ~ N(0, 1/in_features) (so
    activations keep their scale and the logits are far from ties), embeddings ~ N(0, 1),
    norms around 1.  The same seed gives the same weights."""
    rng = np.random.default_rng(seed)
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            yield name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            continue
        rows, cols = shape
        step = max(1, BLOCK_BYTES // (4 * cols))
        scale = None if "embed_tokens" in name else np.float32(1 / np.sqrt(cols))
        for r0 in range(0, rows, step):
            block = rng.standard_normal((min(step, rows - r0), cols), dtype=np.float32)
            if scale is not None:
                block *= scale
            yield name, block


def random_tensors(cfg, seed=0):
    """{name: float32 array}: the weights write_checkpoint writes for this seed, whole
    (for tests of small models)."""
    parts = {}
    for name, block in _blocks(cfg, seed):
        parts.setdefault(name, []).append(block)
    return {n: (b[0] if len(b) == 1 else np.concatenate(b)) for n, b in parts.items()}


class Progress:
    """A one-line progress bar on a terminal (redrawn at most 10 times a second); on
    anything else, nothing."""

    def __init__(self, total, label, stream=None, enabled=None, width=30):
        self.total, self.label, self.width, self.done = max(1, total), label, width, 0
        self.stream = sys.stderr if stream is None else stream
        self.enabled = (self.stream.isatty() if enabled is None else enabled)
        self._last = 0.0
        self._t0 = time.monotonic()

    def add(self, n):
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now):
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(frac * self.width)
        self.stream.write(f"\r{self.label} [{bar:<{self.width}}] {100 * frac:3.0f}% "
                          f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB {now - self._t0:.0f} s")
        self.stream.flush()

    def close(self):
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


_CHECKPOINT_FILES = ("config.json", "tokenizer.json")


def _prepare_dir(out_dir, force):
    """Refuses to write over anything unless force; with force, removes the files of an
    earlier checkpoint (config.json, tokenizer.json, *.safetensors) and nothing else, so
    that no stale shard survives next to the new weights."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise KieError(f"{out_dir}: exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not force:
            raise KieError(f"{out_dir}: exists and is not empty; choose a new directory, or pass --force to "
                           f"replace the checkpoint in it")
        for f in os.listdir(out_dir):
            if f in _CHECKPOINT_FILES or f.endswith(".safetensors"):
                os.remove(os.path.join(out_dir, f))
    os.makedirs(out_dir, exist_ok=True)


def write_checkpoint(cfg, out_dir, seed=0, tensors=None, force=False, progress=None):
    """Writes cfg (its torch_dtype: bfloat16 or float32) with random (or given) weights.
    out_dir must not exist or be empty, unless force.  progress: a Progress-like object
    (add(bytes), close()) told of every block written."""
    if cfg.vocab_size < BYTE_VOCAB:
        raise ConfigError(f"vocab_size={cfg.vocab_size}: the byte-level tokenizer needs at least {BYTE_VOCAB}")
    _prepare_dir(out_dir, force)
    bf16 = cfg.torch_dtype == "bfloat16"
    dt = "BF16" if bf16 else "F32"
    shapes = expected_shapes(cfg)
    if tensors is None:
        blocks = _blocks(cfg, seed)
    else:
        for n, shape in shapes.items():
            if n not in tensors or tuple(np.shape(tensors[n])) != tuple(shape):
                raise ConfigError(f"tensor {n!r}: expected shape {list(shape)}, got "
                                  f"{list(np.shape(tensors[n])) if n in tensors else 'nothing'}")
        blocks = ((n, tensors[n]) for n in shapes)

    def stored():
        for _name, block in blocks:
            out = float32_to_bf16_bits(block) if bf16 else np.ascontiguousarray(block, np.float32)
            yield out
            if progress is not None:
                progress.add(out.nbytes)

    write_stream(os.path.join(out_dir, "model.safetensors"), [(n, dt, s) for n, s in shapes.items()], stored(),
                 metadata={"format": "pt"})
    if progress is not None:
        progress.close()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    byte_level_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir


def checkpoint_bytes(cfg):
    """Bytes of model.safetensors' data for cfg."""
    item = 2 if cfg.torch_dtype == "bfloat16" else 4
    return sum(int(np.prod(s)) for s in expected_shapes(cfg).values()) * item
