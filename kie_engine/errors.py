"""The engine's exceptions: each names the file or field at fault.  They inherit the
builtin a caller would catch (ValueError, FileNotFoundError) and KieError."""


class KieError(Exception):
    """Base of every engine error."""


class ConfigError(KieError, ValueError):
    """A model config (config.json or a preset) is missing a field or holds a bad value."""


class SettingError(KieError, ValueError):
    """A KIE_* environment variable (kie_engine/settings.py) holds a bad value."""


class CheckpointError(KieError, ValueError):
    """A checkpoint directory is inconsistent: missing, extra or mis-shaped tensors, bad files."""


class NonFiniteLogitsError(CheckpointError):
    """A step's logits hold a NaN or an infinity: the weights are corrupt (or overflow
    float32), so every later token would be garbage; generation stops instead."""


class NonFiniteWeightsError(CheckpointError):
    """A tensor holds a NaN or an infinity: the file is corrupt.  convert refuses to write
    it (rounding or quantizing would hide the damage: int8 blocks drop a NaN, bf16 may turn
    it into a plain number)."""


class CheckpointNotFoundError(KieError, FileNotFoundError):
    """The checkpoint directory, or a file it needs, does not exist."""


class ShardingError(KieError, ValueError):
    """The model cannot be split over this many lanes (ranks)."""


class PromptTooLongError(KieError, ValueError):
    """The prompt (plus the tokens to generate) does not fit the context."""


class GpuError(KieError, RuntimeError):
    """The GPU engine failed: a CUDA call, a kernel's report, or the lanes' communicator."""


class GpuUnavailableError(GpuError):
    """The GPU path was asked for, but this build has no CUDA or no GPU is visible."""


class GpuMemoryError(GpuError, MemoryError):
    """The model (weights, KV cache, buffers) does not fit the GPU's free memory."""


class GpuArgumentError(GpuError, ValueError):
    """A shape or argument the GPU engine does not take."""


class GpuTimeoutError(GpuError, TimeoutError):
    """A decode step did not finish in time (a lane stopped answering)."""


class UnsupportedFormatError(KieError, ValueError):
    """A well-formed checkpoint that uses something this engine does not implement: an
    architecture, a tensor type, a tokenizer kind."""


class CpuEngineError(KieError, RuntimeError):
    """The native CPU engine failed: its module is missing, its thread pool, or the lanes'
    communicator."""


class KvMemoryError(KieError, MemoryError):
    """A sequence's KV cache does not fit the KV memory the engine was given (with what
    the running sequences hold)."""
