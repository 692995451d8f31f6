"""Hugging Face Llama-format checkpoint directories, from local disk only:
config.json, *.safetensors (one file or shards), tokenizer.json.

Checkpoint(dir) checks every tensor the config implies is present, once, with its
shape, before any weight is read; tensor(name, rows, cols) reads (a block of) one
as float32."""
import glob
import os

import numpy as np

from ..errors import CheckpointError, CheckpointNotFoundError
from . import jsonfile
from .config import ModelConfig
from .safetensors_io import SafetensorsFile, to_float32

# Buffers some exporters store that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_layer_count(cfg, n_tensors, where):
    """Refuses a config with more layers than the checkpoint has tensors, before
    expected_shapes() lists 9 names per layer: a claimed 2^31 layers would take that long.
    (Fewer extra layers get the check's own message: which tensors are missing.)"""
    if cfg.num_hidden_layers > n_tensors:
        raise CheckpointError(f"{where} = {cfg.num_hidden_layers} layers, but the checkpoint holds only "
                              f"{n_tensors} tensors (9 per layer)")


def expected_shapes(cfg):
    """{tensor name: shape} of a checkpoint of this config (HF LlamaForCausalLM names)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


class Checkpoint:
    def __init__(self, model_dir, dtp_delay=None):
        if not os.path.isdir(model_dir):
            raise CheckpointNotFoundError(f"{model_dir}: no such checkpoint directory")
        self.dir = model_dir
        cfg = ModelConfig.load(model_dir)
        self.config = cfg if dtp_delay is None else cfg.replace(dtp_delay=dtp_delay)
        paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not paths:
            raise CheckpointNotFoundError(f"{model_dir}: no *.safetensors file (only the safetensors format is read)")
        self._where = {}
        for path in paths:
            f = SafetensorsFile(path)
            for name in f.tensors:
                if name in self._where:
                    raise CheckpointError(f"{path}: tensor {name!r} is also in {self._where[name].path}")
                self._where[name] = f
        self._check()

    def _check(self):
        cfgpath = os.path.join(self.dir, "config.json")
        check_layer_count(self.config, len(self._where), f"{cfgpath}: 'num_hidden_layers'")
        want = expected_shapes(self.config)
        missing = [n for n in want if n not in self._where]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise CheckpointError(f"{self.dir}: tensor(s) {', '.join(missing[:3])}{more} missing for the model "
                                  f"that {cfgpath} describes")
        for name, f in self._where.items():
            if name in want:
                shape = f.tensors[name][1]
                if tuple(shape) != tuple(want[name]):
                    raise CheckpointError(f"{f.path}: tensor {name!r} has shape {list(shape)}, but {cfgpath} "
                                          f"implies {list(want[name])}")
            elif not (name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.config.tie_word_embeddings)):
                raise CheckpointError(f"{f.path}: unexpected tensor {name!r} (not part of the model {cfgpath} describes)")
        for name, f in self._where.items():
            if f.dtype(name) not in ("F32", "BF16", "F16"):
                raise CheckpointError(f"{f.path}: tensor {name!r} has dtype {f.dtype(name)}; weights must be floats")

    def tensor(self, name, rows=None, cols=None):
        """float32 copy of tensor[rows, cols] (slices or index arrays; None = all)."""
        f = self._where[name]
        a = f.raw(name)
        if rows is not None:
            a = a[rows]
        if cols is not None:
            a = a[:, cols]
        dt = f.dtype(name)
        return to_float32(a, dt) if dt != "F16" else np.ascontiguousarray(a, dtype=np.float32)

    def stored(self, name):
        """(array, dtype name) of a tensor as the file stores it, memory-mapped and not
        converted (BF16 as uint16): what the native CPU engine points its kernels at."""
        f = self._where[name]
        return f.raw(name), f.dtype(name)

    def tokenizer(self):
        from .tokenizer import load_tokenizer
        return load_tokenizer(self.tokenizer_path())

    def _tokenizer_config(self):
        path = os.path.join(self.dir, "tokenizer_config.json")
        if not os.path.isfile(path):
            return path, {}
        tc = jsonfile.load(path, CheckpointError, limit=64 << 20)
        if not isinstance(tc, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        return path, tc

    def special_tokens(self):
        """{'bos_token': text, ...} of those tokenizer_config.json names."""
        out = {}
        for key, v in self._tokenizer_config()[1].items():
            if key in ("bos_token", "eos_token", "unk_token", "pad_token"):
                v = v.get("content") if isinstance(v, dict) else v
                if isinstance(v, str):
                    out[key] = v
        return out

    def chat_template(self):
        """The directory's chat template (chat.ChatTemplate) from chat_template.jinja or
        tokenizer_config.json, where transformers writes it; None when it has none."""
        from .chat import ChatTemplate
        jinja_path = os.path.join(self.dir, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            try:
                with open(jinja_path, encoding="utf-8") as f:
                    return ChatTemplate(f.read(), self.special_tokens(), source=jinja_path)
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{jinja_path}: cannot read the chat template: {e}") from None
        tc_path, tc = self._tokenizer_config()
        text = tc.get("chat_template")
        if isinstance(text, list):  # named templates: [{"name", "template"}, ...]
            text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
        if text is None:
            return None
        if not isinstance(text, str):
            raise CheckpointError(f"{tc_path}: field 'chat_template' is not a string")
        return ChatTemplate(text, self.special_tokens(), source=f"{tc_path}: field 'chat_template'")

    def tokenizer_path(self):
        path = os.path.join(self.dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"{path}: no such file (the tokenizer is read from tokenizer.json)")
        return path
