"""Generated ids to the text a client receives: detokenized as they come (StreamDecoder),
cut at the first stop string.  A stop string may span tokens, so text that could still
become one (a suffix of what came that is a prefix of some stop string) is held back
until the next piece decides it."""
from ..formats.tokenizer import StreamDecoder


class StopMatcher:
    def __init__(self, stops=()):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit = False

    def _pending(self, buf, limit):
        """The first position before `limit` from which the rest of buf is a proper prefix
        of a stop string (more text could still make it one there), or -1."""
        for j in range(limit):
            rest = buf[j:]
            if any(len(s) > len(rest) and s.startswith(rest) for s in self.stops):
                return j
        return -1

    def _first_stop(self, buf):
        return min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)

    def feed(self, piece):
        """The text that can be given out now; after a stop string, nothing more.  A stop
        string found is final only once no stop string that would start earlier can still
        complete: the text is cut where a stop string first starts, as if it came whole."""
        if self.hit:
            return ""
        buf = self.held + piece
        cut = self._first_stop(buf)
        pend = self._pending(buf, cut if cut >= 0 else len(buf))
        if pend >= 0:
            self.held = buf[pend:]
            return buf[:pend]
        self.held = ""
        if cut >= 0:
            self.hit = True
            return buf[:cut]
        return buf

    def flush(self):
        """The end of the text: what was held back is cut at a stop string it holds, and
        given out before it."""
        if self.hit:
            return ""
        out, self.held = self.held, ""
        cut = self._first_stop(out)
        if cut >= 0:
            self.hit = True
            out = out[:cut]
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
