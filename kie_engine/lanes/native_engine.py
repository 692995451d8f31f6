"""What the CPU and CUDA engines' Python objects share: each owns one C engine handle."""


class OwnsNativeEngine:
    """self._e is the C engine (or None); _destroy frees it.  close() frees it once, and
    so do leaving a with block and garbage collection."""
    _e = None

    @staticmethod
    def _destroy(e):
        raise NotImplementedError("a subclass frees its C engine here")

    def close(self):
        if self._e is not None:
            self._destroy(self._e)
            self._e = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
