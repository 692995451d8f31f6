"""KIE: an inference engine for Llama-format (Laneformer) models, tensor parallel
over KCCL ranks ("lanes"), with Delayed Tensor Parallelism.  One decode loop drives
three engines: the native CPU engine (kie_engine/cpu, the default), the CUDA engine
(kie_engine/gpu) and the numpy float32 reference they are tested against (reference/).
By job: formats/ reads and writes checkpoints, lanes/ plans the lanes and starts a rank,
generate.py is the decode loop, __main__.py the CLI and serve/ the HTTP server.
docs/kie.md is the guide (CLI, checkpoints, lanes, DTP); docs/layout.md says where
each part lives.

    python -m kie_engine init --config tiny --dtp-delay 1 --out /tmp/tiny
    mpiexec -n 2 python -m kie_engine generate --model /tmp/tiny --prompt "def fib("
"""
from .errors import CheckpointError, CheckpointNotFoundError, ConfigError, KieError, PromptTooLongError, ShardingError
from .formats.checkpoint import Checkpoint
from .formats.config import ModelConfig, preset
from .generate import Sampling, generate
from .reference.model import Model
from .reference.sharded import load_model

__all__ = ["Checkpoint", "ModelConfig", "preset", "Model", "load_model", "generate", "Sampling", "KieError",
           "ConfigError", "CheckpointError", "CheckpointNotFoundError", "ShardingError", "PromptTooLongError"]
