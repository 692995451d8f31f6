"""Generated ids to the text a client receives: detokenized as they come (StreamDecoder),
cut at the first stop string.  A stop string may span tokens, so text that could still
become one (a suffix of what came that is a prefix of some stop string) is held back
until the next piece decides it."""
from ..tokenizer import StreamDecoder


class StopMatcher:
    def __init__(self, stops=()):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit = False

    def _held_back(self, buf):
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, piece):
        """The text that can be given out now; after a stop string, nothing more."""
        if self.hit:
            return ""
        buf = self.held + piece
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self.held = True, ""
            return buf[:cut]
        keep = self._held_back(buf)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self):
        """The end of the text: what was held back was no stop string after all."""
        out, self.held = ("" if self.hit else self.held), ""
        return out


class TextStream:
    """push(id) -> text to send now; finish() -> the rest.  .hit: a stop string ended it."""

    def __init__(self, tokenizer, stops=()):
        self.decoder = StreamDecoder(tokenizer)
        self.matcher = StopMatcher(stops)

    @property
    def hit(self):
        return self.matcher.hit

    def push(self, token_id):
        return self.matcher.feed(self.decoder.push(token_id))

    def finish(self):
        out = self.matcher.feed(self.decoder.flush())
        return out + self.matcher.flush()
