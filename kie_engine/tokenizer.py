"""Tokenizers: tokenizer.json through the `tokenizers` package, and the small
byte-level one that `init` checkpoints carry (256 byte tokens + <s>, </s>)."""
from .config import SPECIAL_TOKENS
from .errors import CheckpointError


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


def load_tokenizer(path):
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the package raises a plain Exception for a bad file
        raise CheckpointError(f"{path}: not a valid tokenizer.json: {e}") from None


class StreamDecoder:
    """Turns generated ids into text pieces as they come, holding back an incomplete
    UTF-8 sequence (a byte-level token may be half a character)."""

    def __init__(self, tokenizer):
        self.tk, self.ids, self.done = tokenizer, [], ""

    def push(self, token_id):
        self.ids.append(int(token_id))
        text = self.tk.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece, self.done = text[len(self.done):], text
        return piece
