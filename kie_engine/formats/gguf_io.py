"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

GGUFCheckpoint(path) has the interface of checkpoint.Checkpoint: `config` (a ModelConfig
from the file's metadata), `tensor(name, rows, cols)` (float32, under the Hugging Face
tensor names and layout), `tokenizer()` (a `tokenizers.Tokenizer` built from the
metadata) and `chat_template()`; so the lane plans, the reference model and the
engines load it unchanged.

Tensor types read: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K (dequantized by
quant.dequantize, block by block, only for the rows a lane asks for; `raw_tensor()` gives the stored
blocks themselves, for the native CPU kernels).  llama.cpp's converter permutes the rows
of the Q and K projections within each head (its RoPE rotates adjacent pairs, Hugging
Face's rotates the two halves of a head); `tensor()` undoes that, so the engine sees the
Hugging Face layout."""
import os

import numpy as np

from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError, UnsupportedFormatError
from .checkpoint import check_layer_count, expected_shapes
from .config import ModelConfig
from .gguf_check import check_file
# The types read here (gguf_types, every one dequantized by kie_engine.formats.quant); anything
# else is refused by name.
from .gguf_types import BLOCKS as _BLOCKS, FLOATS as _FLOATS, NAMES as _TYPE_NAMES
from .quant import check_finite, dequantize

ARCHITECTURES = ("llama",)
TOKENIZER_MODELS = ("gpt2",)  # byte-level BPE
# tokenizer.ggml.pre -> how text is split before BPE (as llama.cpp's llama-vocab does):
# "gpt2"/"default": GPT-2's regex; "smollm": every digit alone, then GPT-2's regex.
PRE_TOKENIZERS = ("default", "gpt2", "smollm")

# Hugging Face name suffix -> GGUF name suffix (per layer), and whole-model tensors.
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_MODEL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(hf_name):
    """The GGUF tensor name of a Hugging Face Llama tensor name."""
    if hf_name in _MODEL_NAMES:
        return _MODEL_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    raise KeyError(hf_name)


def unpermute_rows(n_rows, head_dim):
    """For each Hugging Face row of a Q or K projection, the GGUF row holding it.

    llama.cpp stores head h's rows as pairs (i, i + head_dim/2) next to each other: HF row
    h*hd + half*hd/2 + i is GGUF row h*hd + 2*i + half."""
    r = np.arange(n_rows)
    j, half = r % head_dim, head_dim // 2
    return r - j + 2 * (j % half) + j // half


# -- the reader --------------------------------------------------------------------------------

class _PastEnd(Exception):
    def __init__(self, offset, end):
        super().__init__(offset, end)
        self.offset, self.end = offset, end


_READER = None


def _reader_class():
    global _READER
    if _READER is not None:
        return _READER
    try:
        import gguf
    except ImportError:
        raise UnsupportedFormatError("reading GGUF files needs the gguf package "
                                     "(pip install -e '.[kie]', or pip install gguf)") from None

    class Reader(gguf.GGUFReader):
        """gguf's reader, but a read past the end of the file raises _PastEnd (the stock one
        fails later, in a reshape, without saying where), and tensor descriptions are
        checked (type, extent) before the stock code builds views of them."""
        stage = "the file header"

        def _get(self, offset, dtype, count=1, override_order=None):
            if type(self.data) is np.memmap:
                # A plain ndarray view of the same mapping: every slice of an np.memmap runs
                # Python-level subclass hooks, which made opening a 50k-token vocabulary
                # take ~3 s instead of ~1 s.
                self.data = self.data.view(np.ndarray)
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise _PastEnd(int(offset), end)
            return super()._get(offset, dtype, count, override_order)

        def _build_fields(self, offs, count):
            self.stage = "the metadata"
            return super()._build_fields(offs, count)

        def _build_tensor_info(self, offs, count):
            self.stage = "the tensor table"
            return super()._build_tensor_info(offs, count)

        def _build_tensors(self, start_offs, fields):
            self.stage = "the tensor data"
            self.described = []
            for f in fields:  # parts: name length, name, n_dims, dims, type, offset
                dims, raw_type, off = f.parts[3], int(f.parts[4][0]), int(f.parts[5][0])
                self.described.append((f.name, [int(x) for x in dims], raw_type, int(start_offs) + off))
            _check_described(self.path, self.described, len(self.data))
            return super()._build_tensors(start_offs, fields)

    _READER = Reader
    return Reader


def _type_name(raw_type):
    try:
        import gguf
        return gguf.GGMLQuantizationType(raw_type).name
    except (ImportError, ValueError):
        return f"type id {raw_type}"


def _nbytes(dims, raw_type):
    n_el, n_bytes = _BLOCKS[raw_type]
    return int(np.prod(dims, dtype=np.int64)) // n_el * n_bytes


def _check_described(path, described, size):
    for name, dims, raw_type, start in described:
        if raw_type not in _TYPE_NAMES:
            raise UnsupportedFormatError(
                f"{path}: tensor {name!r} has type {_type_name(raw_type)}, which this engine does not read "
                f"(supported: {', '.join(_TYPE_NAMES.values())}); re-quantize the model to one of those")
        n_el = _BLOCKS[raw_type][0]
        if dims and dims[0] % n_el:
            raise CheckpointError(f"{path}: tensor {name!r} ({_TYPE_NAMES[raw_type]}) has rows of {dims[0]} values, "
                                  f"not a multiple of its block size {n_el}")
        end = start + _nbytes(dims, raw_type)
        if end > size:
            raise CheckpointError(f"{path}: tensor {name!r} ({_TYPE_NAMES[raw_type]}, {list(reversed(dims))}) "
                                  f"needs bytes {start}..{end}, but the file has {size} bytes: truncated file")


def open_reader(path):
    """The gguf package's reader of `path`, every failure a CheckpointError naming the file."""
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{path}: no such GGUF file")
    size = os.path.getsize(path)
    if size < 24:
        raise CheckpointError(f"{path}: {size} bytes, too short to be a GGUF file (truncated?)")
    cls = _reader_class()
    check_file(path)  # nothing the file claims is trusted by the reader below
    # Made in two steps so that, when __init__ fails, what it had parsed (reader.stage,
    # reader.fields) can say where the file went wrong.
    reader = cls.__new__(cls)
    reader.path = path
    try:
        reader.__init__(path)
    except _PastEnd as e:
        where = reader.stage
        fields = getattr(reader, "fields", None) or {}
        meta = [k for k in fields if not k.startswith("GGUF.")]
        if where == "the metadata":
            where += f", in the entry after {meta[-1]!r}" if meta else ", in its first entry"
        raise CheckpointError(f"{path}: the file ends at byte {size}, inside {where} (a read of bytes "
                              f"{e.offset}..{e.end}): truncated file") from None
    except (UnsupportedFormatError, CheckpointError):
        raise
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({reader.stage}): {e}") from None
    return reader


class Metadata:
    """The key/value metadata of a GGUF file, with errors naming the file and key."""

    def __init__(self, path, reader):
        self.path, self._fields = path, reader.fields

    def __contains__(self, key):
        return key in self._fields

    def get(self, key, default=None, kind=None):
        f = self._fields.get(key)
        if f is None:
            return default
        try:
            v = f.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: metadata {key!r} cannot be read: {e}") from None
        if kind is not None and not _is_kind(v, kind):
            raise CheckpointError(f"{self.path}: metadata {key!r} = {_short(v)} is not {kind}")
        return v

    def need(self, key, kind=None):
        if key not in self._fields:
            raise CheckpointError(f"{self.path}: metadata {key!r} is missing")
        return self.get(key, kind=kind)

    def _array(self, key, of=None):
        """The field of an array entry (None when absent); `of`: the element type it must have."""
        import gguf
        f = self._fields.get(key)
        if f is None:
            return None
        if f.types[:1] != [gguf.GGUFValueType.ARRAY] or (of is not None and f.data and f.types[-1] != of):
            what = f"an array of {of.name}" if of is not None else "an array"
            raise CheckpointError(f"{self.path}: metadata {key!r} is not {what} "
                                  f"(it holds {'/'.join(t.name for t in f.types)})")
        return f

    def count(self, key):
        """The number of entries of an array field (None when absent), without decoding them."""
        f = self._array(key)
        return None if f is None else len(f.data)

    def strings(self, key):
        """A string array, decoded (fast path: the vocabulary has ~50 k entries)."""
        import gguf
        f = self._array(key, gguf.GGUFValueType.STRING)
        if f is None:
            return None
        try:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: metadata {key!r} holds a string that is not UTF-8: {e}") from None


def _is_kind(v, kind):
    if kind == "an integer":
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)
    if kind == "a number":
        return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
    if kind == "a string":
        return isinstance(v, str)
    if kind == "a boolean":
        return isinstance(v, (bool, np.bool_))
    if kind == "a list":
        return isinstance(v, list)
    raise AssertionError(kind)


def _short(v):
    s = repr(v)
    return s if len(s) < 60 else s[:57] + "..."


class GGUFCheckpoint:
    """A GGUF model file, behind the same interface as checkpoint.Checkpoint."""

    def __init__(self, path, dtp_delay=None):
        self.path = self.dir = path
        reader = open_reader(path)
        self.meta = Metadata(path, reader)
        self._data = reader.data
        cfg = self._config()
        self.config = cfg if dtp_delay is None else cfg.replace(dtp_delay=dtp_delay)
        self._tensors = {name: (dims, t, start) for name, dims, t, start in reader.described}
        self._check()

    # -- configuration ---------------------------------------------------------------------------
    def _config(self):
        m, path = self.meta, self.path
        arch = m.need("general.architecture", "a string")
        if arch not in ARCHITECTURES:
            raise UnsupportedFormatError(f"{path}: metadata 'general.architecture' = {arch!r}; this engine runs "
                                         f"{', '.join(map(repr, ARCHITECTURES))} models only")
        k = lambda key: f"{arch}.{key}"  # noqa: E731
        scaling = m.get(k("rope.scaling.type"), "none")
        if scaling not in ("none", None):
            raise UnsupportedFormatError(f"{path}: metadata {k('rope.scaling.type')!r} = {scaling!r}; only RoPE "
                                         f"without scaling is supported")
        heads = m.need(k("attention.head_count"), "an integer")
        kv_heads = m.get(k("attention.head_count_kv"), heads, "an integer")
        hidden = m.need(k("embedding_length"), "an integer")
        head_dim = m.get(k("attention.key_length"), hidden // heads if heads else 0, "an integer")
        for key in (k("attention.value_length"), k("rope.dimension_count")):
            v = m.get(key, head_dim, "an integer")
            if v != head_dim:
                raise UnsupportedFormatError(f"{path}: metadata {key!r} = {v}, but the head size is {head_dim}; "
                                             f"only full-head RoPE with equal key and value sizes is supported")
        vocab = m.get(k("vocab_size"), m.count("tokenizer.ggml.tokens"), "an integer")
        if vocab is None:
            raise CheckpointError(f"{path}: neither {k('vocab_size')!r} nor 'tokenizer.ggml.tokens' gives the "
                                  f"vocabulary size")
        bos = m.get("tokenizer.ggml.bos_token_id", None, "an integer")
        eos = m.get("tokenizer.ggml.eos_token_id", None, "an integer")
        try:
            return ModelConfig(
                vocab_size=int(vocab), hidden_size=int(hidden),
                intermediate_size=int(m.need(k("feed_forward_length"), "an integer")),
                num_hidden_layers=int(m.need(k("block_count"), "an integer")),
                num_attention_heads=int(heads), num_key_value_heads=int(kv_heads), head_dim=int(head_dim),
                max_position_embeddings=int(m.get(k("context_length"), 2048, "an integer")),
                rope_theta=float(m.get(k("rope.freq_base"), 10000.0, "a number")),
                rms_norm_eps=float(m.get(k("attention.layer_norm_rms_epsilon"), 1e-5, "a number")),
                tie_word_embeddings=False,  # set from the tensors below
                bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
                torch_dtype="float32")
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def _check(self):
        cfg = self.config
        tied = "output.weight" not in self._tensors
        self.config = cfg = cfg.replace(tie_word_embeddings=tied)
        check_layer_count(cfg, len(self._tensors), f"{self.path}: metadata '{self.meta.get('general.architecture')}"
                                                   f".block_count'")
        want = {gguf_name(n): (n, shape) for n, shape in expected_shapes(cfg).items()}
        missing = [g for g in want if g not in self._tensors]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise CheckpointError(f"{self.path}: tensor(s) {', '.join(missing[:3])}{more} missing for the model its "
                                  f"metadata describes")
        for g, (dims, t, _start) in self._tensors.items():
            if g not in want:
                what = " (RoPE frequency factors: rope scaling is not supported)" if g == "rope_freqs.weight" else ""
                raise CheckpointError(f"{self.path}: unexpected tensor {g!r}{what}")
            shape = tuple(reversed(dims))
            if shape != tuple(want[g][1]):
                raise CheckpointError(f"{self.path}: tensor {g!r} has shape {list(shape)}, but the metadata implies "
                                      f"{list(want[g][1])}")
            if len(shape) == 1 and t not in _FLOATS:
                raise CheckpointError(f"{self.path}: tensor {g!r} is a vector stored as {_TYPE_NAMES[t]}")

    # -- weights ---------------------------------------------------------------------------------
    def tensor_type(self, name):
        """The GGUF storage type name ('Q4_1', ...) of a Hugging Face tensor name."""
        return _TYPE_NAMES[self._tensors[gguf_name(name)][1]]

    def _stored(self, name):
        """(GGUF name, dims, ggml type, the stored bytes) of tensor `name` (KeyError if absent)."""
        g = gguf_name(name)
        if g not in self._tensors:
            raise KeyError(name)
        dims, t, start = self._tensors[g]
        return g, dims, t, self._data[start:start + _nbytes(dims, t)]

    def tensor(self, name, rows=None, cols=None):
        """float32 copy of tensor[rows, cols] in the Hugging Face layout (slices or index
        arrays; None = all), dequantizing only the rows asked for."""
        g, dims, t, raw = self._stored(name)
        if len(dims) == 1:
            out = dequantize(raw.reshape(1, -1), t, dims[0])[0]
            check_finite(out, self.path, g, "refusing to load it")
            return out if rows is None else np.ascontiguousarray(out[rows])
        n_cols, n_rows = dims
        raw = raw.reshape(n_rows, -1)
        cfg = self.config
        if g.endswith(("attn_q.weight", "attn_k.weight")):
            idx = unpermute_rows(n_rows, cfg.head_dim)
            raw = raw[idx if rows is None else idx[rows]]
        elif rows is not None:
            raw = raw[rows]
        out = dequantize(raw, t, n_cols)
        check_finite(out, self.path, g, "refusing to load it")
        return out if cols is None else np.ascontiguousarray(out[:, cols])

    def raw_tensor(self, name, rows=None, hf_order=True):
        """The stored blocks of tensor[rows], not dequantized: (raw, type, cols), raw a
        uint8 array (len(rows), bytes per row) and type the ggml type id (kq.h's KQ_*).

        rows: None (all), a slice or an index array, in the Hugging Face row order.  A
        slice is a view of the memory-mapped file (nothing read until used); the Q and
        K projections with hf_order=True are gathered, since llama.cpp permuted their
        rows (whole rows: each row's blocks stay as stored, so the permutation moves
        rows and touches no block).  hf_order=False gives the stored order instead
        (for an engine that rotates adjacent pairs, as llama.cpp does): then `rows`
        counts stored rows."""
        g, dims, t, raw = self._stored(name)
        if len(dims) == 1:
            raw, n_cols = raw.reshape(1, -1), dims[0]
        else:
            n_cols, n_rows = dims
            raw = raw.reshape(n_rows, -1)
            if hf_order and g.endswith(("attn_q.weight", "attn_k.weight")):
                idx = unpermute_rows(n_rows, self.config.head_dim)
                rows = idx if rows is None else idx[rows]
        if rows is not None:
            raw = raw[rows]
        return raw, t, n_cols

    # -- tokenizer and chat ----------------------------------------------------------------------
    def tokenizer(self):
        n = self.meta.count("tokenizer.ggml.tokens")
        if n is not None and n > self.config.vocab_size:  # its ids would index past the embedding
            raise CheckpointError(f"{self.path}: metadata 'tokenizer.ggml.tokens' has {n} tokens, more than the "
                                  f"model's vocab_size {self.config.vocab_size}")
        return gguf_tokenizer(self.meta)

    def special_tokens(self):
        """{'bos_token': text, 'eos_token': ..., 'unk_token': ..., 'pad_token': ...} of those the file names."""
        tokens = self.meta.strings("tokenizer.ggml.tokens") or []
        out = {}
        for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                          ("pad_token", "padding")):
            i = self.meta.get(f"tokenizer.ggml.{key}_token_id", None, "an integer")
            if i is not None and 0 <= i < len(tokens):
                out[name] = tokens[i]
        return out

    def chat_template(self):
        """The file's chat template (chat.ChatTemplate), or None when it has none."""
        from .chat import ChatTemplate
        text = self.meta.get("tokenizer.chat_template", None, "a string")
        if text is None:
            return None
        eot = self.meta.get("tokenizer.ggml.eot_token_id", None, "an integer")
        return ChatTemplate(text, self.special_tokens(), source=f"{self.path}: metadata 'tokenizer.chat_template'",
                            eot_token_id=eot)


def gguf_tokenizer(meta):
    """A `tokenizers.Tokenizer` equivalent to the one the metadata describes (byte-level BPE):
    vocabulary, merges, the pre-tokenizer named by tokenizer.ggml.pre, control tokens as
    special tokens, user-defined ones as added tokens, BOS/EOS added as the flags say."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    path = meta.path
    kind = meta.need("tokenizer.ggml.model", "a string")
    if kind not in TOKENIZER_MODELS:
        raise UnsupportedFormatError(f"{path}: metadata 'tokenizer.ggml.model' = {kind!r}; only byte-level BPE "
                                     f"({', '.join(map(repr, TOKENIZER_MODELS))}) tokenizers are supported")
    pre = meta.get("tokenizer.ggml.pre", "default", "a string")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedFormatError(f"{path}: metadata 'tokenizer.ggml.pre' = {pre!r}; supported pre-tokenizers: "
                                     f"{', '.join(map(repr, PRE_TOKENIZERS))}")
    tokens = meta.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{path}: metadata 'tokenizer.ggml.tokens' is missing or empty")
    merges = []
    for i, m in enumerate(meta.strings("tokenizer.ggml.merges") or []):
        pair = m.split(" ")
        if len(pair) != 2:
            raise CheckpointError(f"{path}: metadata 'tokenizer.ggml.merges'[{i}] = {m!r} is not two tokens")
        merges.append((pair[0], pair[1]))
    types = meta.get("tokenizer.ggml.token_type", None, "a list")
    if types is not None and len(types) != len(tokens):
        raise CheckpointError(f"{path}: metadata 'tokenizer.ggml.token_type' has {len(types)} entries for "
                              f"{len(tokens)} tokens")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate spelling keeps its first id, as a dict lookup would
    for i, (x, y) in enumerate(merges):
        for part in (x, y, x + y):  # the BPE model refuses a merge whose parts or result have no id
            if part not in vocab:
                raise CheckpointError(f"{path}: metadata 'tokenizer.ggml.merges'[{i}] = '{x} {y}': {part!r} is not in "
                                      f"'tokenizer.ggml.tokens'")
    try:
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as e:  # the tokenizers library raises a bare Exception; what the check above missed
        raise CheckpointError(f"{path}: the tokenizer metadata does not make a BPE tokenizer: {e}") from None
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False, "a boolean"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)
    if pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    # CONTROL (3) tokens are special (never split, dropped when decoding with
    # skip_special_tokens); USER_DEFINED (4) ones are matched whole but kept in text.
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types or ()) if k == 3]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types or ()) if k == 4]
    if control:
        tk.add_special_tokens(control)
    if user:
        tk.add_tokens(user)
    if tk.get_vocab_size(with_added_tokens=True) != len(vocab):
        raise CheckpointError(f"{path}: the special tokens of 'tokenizer.ggml.token_type' are not all in "
                              f"'tokenizer.ggml.tokens'")
    pieces, specials = ["$A"], []
    for which in ("bos", "eos"):
        if meta.get(f"tokenizer.ggml.add_{which}_token", False, "a boolean"):
            key = f"tokenizer.ggml.{which}_token_id"
            i = meta.need(key, "an integer")
            if not 0 <= i < len(tokens):
                raise CheckpointError(f"{path}: metadata {key!r} = {i} is outside the vocabulary")
            if which == "bos":
                pieces.insert(0, tokens[i])
            else:
                pieces.append(tokens[i])
            specials.append((tokens[i], int(i)))
    if specials:
        tk.post_processor = processors.TemplateProcessing(single=" ".join(pieces),
                                                          special_tokens=list(dict.fromkeys(specials)))
    return tk
