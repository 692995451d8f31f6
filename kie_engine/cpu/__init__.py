"""KIE's native CPU backend: weights kept in their GGUF block formats (csrc/kq.h, SIMD
kernels picked at run time) and the decode step in C (csrc/kie_cpu.h).  `_native.native()`
gives the cffi (ffi, lib); `kernels` wraps the block kernels for numpy callers;
engine.CpuModel is the decode step's Python face."""
