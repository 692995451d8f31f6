"""`python -m kie_engine convert`: any model the engine reads (a GGUF file, a short name)
written as a Hugging Face Llama directory: config.json, model.safetensors (bfloat16 or
float32, Hugging Face names and layout), tokenizer.json, and tokenizer_config.json with
the special tokens and the chat template; the engine and transformers both load it."""
import json
import os

import numpy as np

from ..errors import CheckpointError
from .checkpoint import expected_shapes
from .quant import check_finite
from .safetensors_io import float32_to_bf16_bits, write


def _tensor_name(ckpt, name):
    """`name` as an error names it: with the file's own name when that differs (GGUF)."""
    if hasattr(ckpt, "raw_tensor"):  # a GGUF file
        from .gguf_io import gguf_name
        return f"{gguf_name(name)} ({name})"
    return name


def convert(ckpt, out_dir, dtype="bfloat16"):
    """Writes `ckpt` (anything with the Checkpoint interface) to out_dir; returns out_dir."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir}: exists and is not a directory")
    cfg = ckpt.config.replace(torch_dtype=dtype)
    tokenizer = ckpt.tokenizer()  # before writing anything: a model without one fails here
    template = ckpt.chat_template()
    stored = {}
    for name in expected_shapes(cfg):  # every tensor read and checked before anything is written
        w = ckpt.tensor(name)
        check_finite(w, ckpt.dir, _tensor_name(ckpt, name))
        stored[name] = ("BF16", float32_to_bf16_bits(w)) if dtype == "bfloat16" else ("F32", w.astype(np.float32))
    os.makedirs(out_dir, exist_ok=True)
    write(os.path.join(out_dir, "model.safetensors"), stored, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    # What tokenizer.json's post-processor adds, said again for transformers' tokenizer class.
    plain, full = (tokenizer.encode("a", add_special_tokens=b).ids for b in (False, True))
    added = len(full) > len(plain)
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings,
          "add_bos_token": added and full[0] != plain[0], "add_eos_token": added and full[-1] != plain[-1],
          **ckpt.special_tokens()}
    if template is not None:
        tc["chat_template"] = template.text
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)
    return out_dir
