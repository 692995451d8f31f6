"""KIE: a thin numpy inference engine for Llama-format (Laneformer) models, tensor
parallel over KCCL ranks, with Delayed Tensor Parallelism (see shared/DESIGN.md).

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
