"""The engine's exceptions: each names the file or field at fault.  They inherit the
builtin a caller would catch (ValueError, FileNotFoundError) and KieError."""


class KieError(Exception):
    """Base of every engine error."""


class ConfigError(KieError, ValueError):
    """A model config (config.json or a preset) is missing a field or holds a bad value."""


class CheckpointError(KieError, ValueError):
    """A checkpoint directory is inconsistent: missing, extra or mis-shaped tensors, bad files."""


class CheckpointNotFoundError(KieError, FileNotFoundError):
    """The checkpoint directory, or a file it needs, does not exist."""


class ShardingError(KieError, ValueError):
    """The model cannot be split over this many lanes (ranks)."""


class PromptTooLongError(KieError, ValueError):
    """The prompt (plus the tokens to generate) does not fit the context."""


class UnsupportedFormatError(KieError, ValueError):
    """A well-formed checkpoint that uses something this engine does not implement: an
    architecture, a tensor type, a tokenizer kind."""
