"""The one exception topology/ raises for bad input (a malformed captured tree,
NVML JSON or topology file; nonsense rank counts).  It is a ValueError, so
callers that do not know topology/ still catch it as bad input."""


class TopologyError(ValueError):
    pass


def load_json(path, label):
    """The JSON document in file `path`; a missing, unreadable or malformed file is a
    TopologyError whose message starts with `label`."""
    import json
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise TopologyError(f"{label}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TopologyError(f"{label}: not JSON ({e})") from None
