"""Reading a checkpoint's JSON files (config.json, tokenizer_config.json, a safetensors
header) as untrusted input: bounded in size, UTF-8, no duplicate keys (which one would
win is not obvious to whoever wrote the file), and every failure an error of the
caller's class naming the file; json's RecursionError on deeply nested input included."""
import json


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"key {k!r} appears twice in one object")
        d[k] = v
    return d


def parse(data, where, error, what="JSON"):
    """The value of JSON text `data` (bytes or str); `error`(f"{where}: ...") on failure."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise error(f"{where}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise error(f"{where}: {what} is nested too deeply to read") from None
    except ValueError as e:
        raise error(f"{where}: {what} is not JSON: {e}") from None


def load(path, error, limit=64 << 20, what="JSON"):
    """The value of the JSON file at `path`, at most `limit` bytes."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise error(f"{path}: cannot read: {e}") from None
    if len(data) > limit:
        raise error(f"{path}: larger than {limit >> 20} MiB, more than a {what} file needs")
    return parse(data, path, error, what)
