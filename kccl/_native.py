"""The raw cffi module; everything else goes through the typed wrapper."""
try:
    from ._kccl_cffi import ffi, lib
except ImportError as e:  # pragma: no cover
    raise ImportError("kccl's native extension is not built: run `python -m pip install -e .` "
                      f"from the source tree ({e})") from None
