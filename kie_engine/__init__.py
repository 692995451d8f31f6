"""KIE: an inference engine for Llama-format (Laneformer) models, tensor parallel
over KCCL ranks ("lanes"), with Delayed Tensor Parallelism.  One decode loop drives
three engines: the native CPU engine (kie_engine/cpu, the default), the CUDA engine
(kie_engine/gpu) and the numpy float32 reference they are tested against (model.py).
docs/kie.md is the guide (CLI, checkpoints, lanes, DTP); docs/layout.md says where
each part lives.

    python -m kie_engine init --config tiny --dtp-delay 1 --out /tmp/tiny
    mpiexec -n 2 python -m kie_engine generate --model /tmp/tiny --prompt "def fib("
"""
from .checkpoint import Checkpoint
from .config import ModelConfig, preset
from .errors import (CheckpointError, CheckpointNotFoundError, ConfigError, KieError, PromptTooLongError,
                     ShardingError)
from .generate import Sampling, generate
from .model import Model
from .tp import load_model

__all__ = ["Checkpoint", "ModelConfig", "preset", "Model", "load_model", "generate", "Sampling", "KieError",
           "ConfigError", "CheckpointError", "CheckpointNotFoundError", "ShardingError", "PromptTooLongError"]
