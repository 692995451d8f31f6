"""KIE's native CPU engine: the decode step in C (csrc/), on weights kept in their GGUF
block formats; engine.CpuModel is its Python face."""
