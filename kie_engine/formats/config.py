"""ModelConfig: the shape of a Laneformer / Llama model, read from and written to a
Hugging Face `config.json` (LlamaForCausalLM keys, plus `dtp_delay`), and presets."""
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from ..errors import CheckpointNotFoundError, ConfigError
from . import jsonfile

# The one formulation of DTP this engine implements (docs/kie.md, "DTP"): a "block"
# is a sublayer (attention or MLP); with delay d, sublayer i reads the residual
# without the outputs of sublayers i-d .. i-1, whose all-reduces are in flight.
DTP_FORMULATION = "ladder-residual/sublayer"
MAX_DIM = 2**31 - 1


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    dtp_delay: int = 0
    torch_dtype: str = "bfloat16"

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            # 2^31 - 1: sizes and token ids stay int32 in the GPU kernels, and no model comes near
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_DIM:
                raise ConfigError(f"config field {f!r} must be a positive integer (at most {MAX_DIM}), got {_short(v)}")
        for f in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"config field {f!r} must be a number, got {_short(v)}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"config field 'tie_word_embeddings' must be true or false, "
                              f"got {_short(self.tie_word_embeddings)}")
        if self.head_dim % 2:
            raise ConfigError(f"config field 'head_dim' must be even for RoPE, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if isinstance(self.dtp_delay, bool) or not isinstance(self.dtp_delay, int) or not 0 <= self.dtp_delay <= 7:
            raise ConfigError(f"config field 'dtp_delay' must be an integer in 0..7, got {self.dtp_delay!r}")
        if not 0 < self.rope_theta < float("inf") or not 0 < self.rms_norm_eps < float("inf"):
            raise ConfigError("config fields 'rope_theta' and 'rms_norm_eps' must be positive and finite")
        if self.torch_dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"config field 'torch_dtype' must be bfloat16 or float32, got {self.torch_dtype!r}")
        for f in ("bos_token_id", "eos_token_id"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ConfigError(f"config field {f!r} must be a token id (an integer), got {_short(v)}")
            if v is not None and not 0 <= v < self.vocab_size:
                raise ConfigError(f"config field {f!r}={v} is outside the vocabulary (size {self.vocab_size})")

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    @property
    def n_params(self):
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_hidden_layers * layer + heads * self.vocab_size * h + h

    # -- config.json ------------------------------------------------------------------------
    def to_hf(self):
        d = dataclasses.asdict(self)
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                 attention_bias=False, mlp_bias=False, rope_scaling=None, initializer_range=0.02,
                 rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
                 use_cache=True, dtp_formulation=DTP_FORMULATION)
        return d

    @classmethod
    def from_hf(cls, d, where="config.json"):
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        if d.get("model_type", "llama") != "llama":
            raise ConfigError(f"{where}: model_type={d.get('model_type')!r}; only llama-format models are supported")
        for key, ok in (("hidden_act", ("silu",)), ("attention_bias", (False, None)), ("mlp_bias", (False, None)),
                        ("rope_scaling", (None,))):
            if d.get(key, ok[0]) not in ok:
                raise ConfigError(f"{where}: {key}={d[key]!r} is not supported (supported: {ok[0]!r})")
        if d.get("dtp_delay", 0) and d.get("dtp_formulation", DTP_FORMULATION) != DTP_FORMULATION:
            raise ConfigError(f"{where}: dtp_formulation={d['dtp_formulation']!r}; this engine implements "
                              f"{DTP_FORMULATION!r}")
        # transformers >= 5 writes rope_parameters {rope_theta, rope_type}; older, rope_theta + rope_scaling
        rp = d.get("rope_parameters") or {}
        if not isinstance(rp, dict) or rp.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope_parameters={rp!r}: only the default RoPE (no scaling) is supported")
        theta = d.get("rope_theta", rp.get("rope_theta", 10000.0))
        need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in need if k not in d]
        if missing:
            raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
        heads, hidden = d["num_attention_heads"], d["hidden_size"]
        head_dim = d.get("head_dim") or (hidden // heads if _is_int(heads) and heads and _is_int(hidden) else 0)
        eos = d.get("eos_token_id")
        if isinstance(eos, list):  # several EOS ids: the first one stops generation here
            eos = eos[0] if eos else None
        kw = dict(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                  intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                  num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
                  head_dim=head_dim, max_position_embeddings=d.get("max_position_embeddings", 2048),
                  rope_theta=_number(theta), rms_norm_eps=_number(d.get("rms_norm_eps", 1e-5)),
                  tie_word_embeddings=d.get("tie_word_embeddings", False),
                  bos_token_id=d.get("bos_token_id"), eos_token_id=eos, dtp_delay=d.get("dtp_delay", 0),
                  torch_dtype=str(d.get("torch_dtype", "bfloat16")).replace("torch.", ""))
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def load(cls, model_dir):
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"{path}: no such file (a checkpoint directory needs config.json)")
        return cls.from_hf(jsonfile.load(path, ConfigError, limit=1 << 20), path)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v):
    """A float from a JSON number; anything else is left for __post_init__ to name."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    try:
        return float(v)
    except OverflowError:  # an integer of hundreds of digits
        return float("inf")


def _short(v):
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# Byte-level vocabulary of `init` checkpoints: 256 bytes, then the special tokens.
SPECIAL_TOKENS = ("<s>", "</s>")
BYTE_VOCAB = 256 + len(SPECIAL_TOKENS)


def preset(name, dtp_delay=0):
    """tiny (tests, seconds), small (benchmark: ~0.6 GB of float32 weights, far above L3),
    2b (about 1.9 B parameters)."""
    common = dict(bos_token_id=256, eos_token_id=257, dtp_delay=dtp_delay, rope_theta=10000.0)
    table = {
        "tiny": dict(vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                     tie_word_embeddings=True),
        "small": dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True),
        "2b": dict(vocab_size=32768, hidden_size=2048, intermediate_size=8192, num_hidden_layers=28,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                   tie_word_embeddings=False, rope_theta=500000.0),
    }
    if name not in table:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(table)}")
    return ModelConfig(**{**common, **table[name]})
