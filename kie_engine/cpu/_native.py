"""The compiled CPU extension (kie_engine.cpu._kie_cpu_cffi): `ffi` and `lib`, or a
clear error when the package was installed without building it."""
from ..errors import KieError

try:
    from ._kie_cpu_cffi import ffi, lib
    _why = None
except ImportError as e:  # depends on the installation
    ffi = lib = None
    _why = e


class CpuNotBuiltError(KieError, ImportError):
    """The native CPU extension is not compiled in this installation."""


_checked = False


def native():
    """(ffi, lib) of the CPU extension; an error saying how to build it when it is missing,
    or a SettingError when KIE_CPU_HIDE, which the kernels' C dispatcher reads, is not a
    value of KIE's settings table."""
    global _checked
    if lib is None:
        raise CpuNotBuiltError(f"the native CPU kernels are not built ({_why}); run `pip install -e .` "
                               f"or `python setup.py build_ext --inplace`")
    if not _checked:
        from ..settings import value
        value("KIE_CPU_HIDE")
        _checked = True
    return ffi, lib
