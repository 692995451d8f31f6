"""The one exception topology/ raises for bad input (a malformed captured tree,
NVML JSON or topology file; nonsense rank counts).  It is a ValueError, so
callers that do not know topology/ still catch it as bad input."""


class TopologyError(ValueError):
    pass
