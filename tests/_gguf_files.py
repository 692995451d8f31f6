"""Small Llama GGUF files written with the gguf package's writer, for the GGUF tests:
random weights in the Hugging Face layout, each tensor stored in a chosen ggml type,
Q and K rows permuted the way llama.cpp's converter permutes them.

write_llama(path, ...) returns {hf name: float32 array}: the values the file holds
(what dequantizing it must give), in the Hugging Face layout."""
import struct

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T

from kie_engine.formats.checkpoint import expected_shapes
from kie_engine.formats.config import ModelConfig

CFG = dict(vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5)

# One type per tensor kind, so that one file exercises every type the engine reads.
TYPES = {"q_proj": T.Q4_1, "k_proj": T.Q8_0, "v_proj": T.F16, "o_proj": T.BF16, "gate_proj": T.F32,
         "up_proj": T.Q4_1, "down_proj": T.Q8_0, "embed_tokens": T.Q8_0, "lm_head": T.Q4_1, "norm": T.F32}

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w, n_heads):
    """What llama.cpp's converter does to Q/K rows: each head's two halves interleaved."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(x, qtype):
    """float32 x stored as a ggml type (what goes into the file)."""
    if qtype == T.F32:
        return x
    if qtype == T.F16:
        return x.astype(np.float16)
    if qtype in (T.Q4_K, T.Q6_K):  # gguf-py dequantizes these but does not quantize them
        from kie_engine.formats import quant
        return quant.quantize(x, int(qtype))
    return gguf.quants.quantize(x, qtype)


def gguf_tensor_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_LAYER[rest[:-len('.weight')]]}.weight"


def _kind(hf):
    for k in TYPES:
        if k in hf and k != "norm":
            return k
    return "norm"


def write_llama(path, seed=0, tied=False, arch="llama", types=None, cfg=None, extra_kv=None, tokenizer=None):
    c = dict(CFG, **(cfg or {}))
    types = dict(TYPES, **(types or {}))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    a = arch
    w.add_uint32(f"{a}.block_count", c["num_hidden_layers"])
    w.add_uint32(f"{a}.context_length", c["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", c["hidden_size"])
    w.add_uint32(f"{a}.feed_forward_length", c["intermediate_size"])
    w.add_uint32(f"{a}.attention.head_count", c["num_attention_heads"])
    w.add_uint32(f"{a}.attention.head_count_kv", c["num_key_value_heads"])
    w.add_uint32(f"{a}.rope.dimension_count", c["head_dim"])
    w.add_float32(f"{a}.rope.freq_base", c["rope_theta"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_uint32(f"{a}.vocab_size", c["vocab_size"])
    for key, (kind, val) in (extra_kv or {}).items():
        getattr(w, f"add_{kind}")(key, val)
    if tokenizer:
        tokenizer(w)
    values = {}
    for name, shape in expected_shapes(ModelConfig(**c, tie_word_embeddings=tied)).items():
        kind = _kind(name)
        if len(shape) == 1:
            x = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            x = (rng.standard_normal(shape) / np.sqrt(shape[1] if kind != "embed_tokens" else 1)).astype(np.float32)
        stored = x
        if "q_proj" in name:
            stored = llama_cpp_permute(x, c["num_attention_heads"])
        elif "k_proj" in name:
            stored = llama_cpp_permute(x, c["num_key_value_heads"])
        qtype = types[kind] if len(shape) == 2 else T.F32
        data = encode(stored, qtype)
        w.add_tensor(gguf_tensor_name(name), data, raw_dtype=qtype)
        held = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(shape) if qtype != T.F32 else stored
        # undo the permutation on the held values: the engine must give the HF layout
        if "q_proj" in name or "k_proj" in name:
            n = c["num_attention_heads"] if "q_proj" in name else c["num_key_value_heads"]
            held = held.reshape(n, shape[0] // n // 2, 2, shape[1]).swapaxes(1, 2).reshape(shape)
        values[name] = np.ascontiguousarray(held, dtype=np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


# -- raw files, for the fuzz tests: every count, length, type and offset as given --------------

def gguf_str(s):
    b = s.encode() if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload):
    """One metadata entry: key, value type id, then `payload` (already encoded, lengths and
    all, so that a test can make them lie)."""
    return gguf_str(key) + struct.pack("<I", vtype) + payload


def kv_u32(key, v):
    return kv(key, 4, struct.pack("<I", v))


def kv_string(key, s):
    return kv(key, 8, gguf_str(s))


def kv_array(key, item_type, n, items=b""):
    return kv(key, 9, struct.pack("<IQ", item_type, n) + items)


def tensor_info(name, dims, ggml_type, offset):
    return gguf_str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + \
        struct.pack("<IQ", ggml_type, offset)


def raw_gguf(kvs=(), tensors=(), data=b"", version=3, n_kv=None, n_tensors=None, alignment=32, magic=b"GGUF"):
    """A GGUF file's bytes: header (counts default to the real ones), the encoded metadata
    entries and tensor descriptions, padding to `alignment`, then `data`."""
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    return body + bytes(-len(body) % alignment) + data
