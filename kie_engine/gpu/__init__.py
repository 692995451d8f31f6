"""KIE's GPU engine: one lane of a (tensor-parallel) Llama / Laneformer model on
one CUDA device, bf16 weights and KV cache, the decode step captured once as a
CUDA graph and replayed from C (see csrc/engine_internal.h for which file does what)."""
from .engine import GpuModel, gpu_available, gpu_built

__all__ = ["GpuModel", "gpu_available", "gpu_built"]
