"""Tokenizers: tokenizer.json through the `tokenizers` package, and the small
byte-level one that `init` checkpoints carry (256 byte tokens + <s>, </s>)."""
import os

from ..errors import CheckpointError
from .config import SPECIAL_TOKENS


def byte_level_tokenizer():
    """Token i < 256 is byte i (in the byte-level alphabet); then <s> (256) and </s> (257);
    encode() prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, processors
    from tokenizers.pre_tokenizers import ByteLevel
    # ByteLevel maps each byte to a printable character; byte b gets id b.
    mapping = _bytes_to_unicode()
    vocab = {mapping[b]: b for b in range(256)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(SPECIAL_TOKENS))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    return tk


def _bytes_to_unicode():
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# Large vocabularies (256 k tokens and their merges) take some tens of MB.
MAX_TOKENIZER_BYTES = 512 << 20


def load_tokenizer(path):
    from tokenizers import Tokenizer
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    if size > MAX_TOKENIZER_BYTES:
        raise CheckpointError(f"{path}: {size} bytes, larger than any tokenizer.json needs "
                              f"({MAX_TOKENIZER_BYTES >> 20} MiB)")
    try:
        return FileTokenizer(Tokenizer.from_file(path), path)
    except BaseException as e:
        if not _tokenizers_failure(e):
            raise
        raise CheckpointError(f"{path}: not a valid tokenizer.json: {e}") from None


def _tokenizers_failure(e):
    """The package raises a plain Exception for a bad file or input, and a Rust panic comes
    out as pyo3's PanicException, which derives from BaseException (and cannot be imported)."""
    return type(e) is Exception or type(e).__name__ == "PanicException"


class FileTokenizer:
    """A tokenizers.Tokenizer read from a checkpoint's tokenizer.json, whose encode() and
    decode() failures are CheckpointErrors naming the file: the file's own regexes run
    there, and one that backtracks past Oniguruma's retry limit panics (found by fuzzing:
    a Split pattern '(a+)+b' on a prompt of 22 a's).  Everything else is the Tokenizer's."""

    def __init__(self, tokenizer, path):
        self._tk, self.path = tokenizer, path

    def __getattr__(self, name):
        return getattr(self._tk, name)

    def _guarded(self, what, *args, **kw):
        try:
            return getattr(self._tk, what)(*args, **kw)
        except BaseException as e:
            if not _tokenizers_failure(e):
                raise
            raise CheckpointError(f"{self.path}: the tokenizer failed in {what}(): {str(e)[:300]}") from None

    def encode(self, *args, **kw):
        return self._guarded("encode", *args, **kw)

    def decode(self, *args, **kw):
        return self._guarded("decode", *args, **kw)


class StreamDecoder:
    """Turns generated ids into text pieces as they come.  Every byte reaches the output:
    bytes that are not valid UTF-8 come out as U+FFFD, and only the one sequence that the
    next token may still complete (a byte-level token can be part of a character) is held
    back, until that token comes or flush() ends the stream.

    Pieces are cut from the text of a window of recent ids (decoded whole, not token by
    token), because a tokenizer may decode a token differently at the start of a text
    (SentencePiece drops the leading space); the window restarts wherever all of its text
    has been given out."""

    def __init__(self, tokenizer):
        self.tk, self.ids = tokenizer, []
        self._prefix = self._read = 0  # window ids[_prefix:]; ids[_prefix:_read] is its given-out context
        self._extra = 0                # characters given out beyond the text of ids[_prefix:_read]

    def _text(self, a, b=None):
        return self.tk.decode(self.ids[a:b], skip_special_tokens=True)

    def push(self, token_id):
        self.ids.append(int(token_id))
        base = len(self._text(self._prefix, self._read)) + self._extra
        text = self._text(self._prefix)
        pending = text.endswith("\ufffd")
        piece = text[base:len(text) - 1 if pending else len(text)]
        if pending:
            self._extra += len(piece)
        else:
            self._prefix, self._read, self._extra = self._read, len(self.ids), 0
        return piece

    def flush(self):
        """Whatever is held back, as it decodes now (an incomplete sequence as U+FFFD)."""
        base = len(self._text(self._prefix, self._read)) + self._extra
        piece = self._text(self._prefix)[base:]
        self._prefix = self._read = len(self.ids)
        self._extra = 0
        return piece
