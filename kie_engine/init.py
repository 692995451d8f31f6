"""`python -m kie_engine init`: a randomly initialised Laneformer checkpoint in the
Hugging Face Llama format (config.json, model.safetensors, tokenizer.json), so that
everything runs offline."""
import json
import os

import numpy as np

from .checkpoint import expected_shapes
from .config import BYTE_VOCAB
from .errors import ConfigError
from .safetensors_io import float32_to_bf16_bits, write
from .tokenizer import byte_level_tokenizer


def random_tensors(cfg, seed=0):
    """{name: float32 array}: matrices ~ N(0, 1/in_features) (so activations keep their
    scale and the logits are far from ties), embeddings ~ N(0, 1), norms around 1."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif "embed_tokens" in name:
            out[name] = rng.standard_normal(shape, dtype=np.float32)
        else:
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / np.sqrt(shape[1]))
    return out


def write_checkpoint(cfg, out_dir, seed=0, tensors=None):
    """Writes cfg (its torch_dtype: bfloat16 or float32) with random (or given) weights."""
    if cfg.vocab_size < BYTE_VOCAB:
        raise ConfigError(f"vocab_size={cfg.vocab_size}: the byte-level tokenizer needs at least {BYTE_VOCAB}")
    os.makedirs(out_dir, exist_ok=True)
    tensors = random_tensors(cfg, seed) if tensors is None else tensors
    if cfg.torch_dtype == "bfloat16":
        stored = {n: ("BF16", float32_to_bf16_bits(t)) for n, t in tensors.items()}
    else:
        stored = {n: ("F32", np.ascontiguousarray(t, np.float32)) for n, t in tensors.items()}
    write(os.path.join(out_dir, "model.safetensors"), stored, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    byte_level_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir
