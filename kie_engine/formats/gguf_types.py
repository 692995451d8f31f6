"""The GGUF tensor types KIE reads: ggml's type code, name, and block (values and bytes
per block), the one table of them in Python.  quant.py (numpy's blocks), gguf_io.py (the
reader), cpu/kernels.py and cpu/engine.py take them from here.

The C kernels keep their own copy (kie_engine/cpu/csrc/kq.h's KQ_* codes, kq_types.c's
blocks), which C needs without Python: the CPU extension's build refuses to compile when
it disagrees with this table (cpu/_build.py), and tests/test_kie_cpu_kernels.py checks the
built library against it."""

F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 14, 30
# code: (name, values per block, bytes per block)
TYPES = {F32: ("F32", 1, 4), F16: ("F16", 1, 2), Q4_0: ("Q4_0", 32, 18), Q4_1: ("Q4_1", 32, 20),
         Q8_0: ("Q8_0", 32, 34), Q4_K: ("Q4_K", 256, 144), Q6_K: ("Q6_K", 256, 210), BF16: ("BF16", 1, 2)}
NAMES = {code: name for code, (name, _e, _b) in TYPES.items()}
CODES = {name: code for code, name in NAMES.items()}
BLOCKS = {code: (elems, nbytes) for code, (_n, elems, nbytes) in TYPES.items()}
FLOATS = (F32, F16, BF16)  # one value per block: what a safetensors checkpoint stores
