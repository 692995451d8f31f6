"""The registry of KCCL_* settings, read from the one table of them.

Every setting KCCL reads is an entry of kccl_settings.def (the C core's
X-macro table, installed as kccl/include/kccl_settings.def) with its type,
default, range and meaning; this module parses that table.  The Python
package resolves the settings from the environment (or from overrides given
to `Communicator(..., config={...})`) and hands them to the C core in a
kcclConfig_t; C programs get the same names and defaults from kcclConfigInit.

    python -m kccl.config     # prints every setting, its value and where it came from
"""
import ast
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from ._native import ffi as _ffi, lib as _lib
from .errors import KcclInvalidArgument

# What config.c strips around a value (C's isspace): a value of only these means unset.
_BLANKS = " \t\n\v\f\r"

def _parser(name, kind, choices=()):
    """Setting `name`'s parser: the C core's (kcclSettingParse, the one kcclConfigInit
    runs on the environment), so that the rules and the error texts cannot differ.
    A choice comes back as its name, a path as its text (surrounding blanks dropped)."""
    key = name.encode()

    def parse(text):
        s = str(text)
        if "\0" in s:
            raise KcclInvalidArgument(f"{name}={s!r}: a setting holds no NUL character")
        out = _ffi.new("long long *")
        if _lib.kcclSettingParse(key, s.encode(), out):
            raise KcclInvalidArgument(_ffi.string(_lib.kcclGetLastError(_ffi.NULL)).decode(errors="replace"))
        if kind == "KCCL_KIND_PATH":
            return s.strip(_BLANKS)
        return choices[out[0]] if kind == "KCCL_KIND_CHOICE" else out[0]
    return parse


@dataclass(frozen=True)
class Setting:
    name: str          # environment variable
    field: str         # kcclConfig_t field (or, with native=False, the override key)
    default: object
    parse: Callable
    doc: str
    native: bool = True  # False: Python resolves it (topology placement); C never reads it
    equal: str = "KCCL_EQUAL_NO"  # must be equal on all ranks: KCCL_EQUAL_ALL, or only on GPU ranks: KCCL_EQUAL_GPU


def _table_path():
    """kccl_settings.def: the copy installed beside the built library, else the source tree's."""
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "include", "kccl_settings.def"),
                 os.path.join(os.path.dirname(here), "kccl_native", "include", "kccl_settings.def")):
        if os.path.exists(path):
            return path
    raise ImportError("kccl_settings.def not found beside the kccl package nor in kccl_native/include")


_TOKEN = re.compile(r'\s+|/\*.*?\*/|//[^\n]*|"(?:[^"\\\n]|\\.)*"|[(),]|[^\s(),"/]+|/', re.S)


def _number(text):
    """An integer literal expression of the table (digits, L suffixes, * and <<)."""
    tree = ast.parse(re.sub(r"(?<=\d)[uUlL]+\b", "", text), mode="eval")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.LShift)):
            a, b = ev(node.left), ev(node.right)
            return a * b if isinstance(node.op, ast.Mult) else a << b
        raise ValueError(f"not an integer literal expression: {text!r}")
    return ev(tree)


def parse_table(text):
    """[(macro, [argument, ...])] of the table's entries, in order: string arguments
    (adjacent literals joined) as str, the rest as their source text."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]  # no preprocessor lines
    tokens = [t for t in _TOKEN.findall("\n".join(lines)) if t.strip() and not t.startswith(("/*", "//"))]
    entries, i = [], 0
    while i < len(tokens):
        if tokens[i] in ("KCCL_SETTING", "KCCL_PY_SETTING", "KCCL_BUILD_SETTING", "KCCL_NCCL_SETTING") \
                and tokens[i + 1] == "(":
            macro, args, cur, depth, i = tokens[i], [], [], 0, i + 2
            while depth or tokens[i] != ")":
                t = tokens[i]
                depth += (t == "(") - (t == ")")
                if t == "," and not depth:
                    args.append(cur)
                    cur = []
                else:
                    cur.append(t)
                i += 1
            args.append(cur)
            entries.append((macro, [ast.literal_eval(" ".join(a)) if a and a[0].startswith('"') else " ".join(a)
                                    for a in args]))
        i += 1
    return entries


def _load():
    with open(_table_path()) as f:
        entries = parse_table(f.read())
    settings, build, shim, choices = [], [], [], {}
    for macro, args in entries:
        if macro == "KCCL_BUILD_SETTING":
            build.append(tuple(args))
            continue
        if macro == "KCCL_SETTING":
            field, name, kind, default, lo, hi, multiple, equal, names, doc = args
        elif macro == "KCCL_NCCL_SETTING":
            field, name, kind, default, lo, hi, doc = args
            shim.append(Setting(name, field, _number(default) if kind != "KCCL_KIND_PATH" else default,
                                _parser(name, kind), doc, native=False))
            continue
        else:
            (field, name, kind, default, names, doc), equal = args, "KCCL_EQUAL_NO"
        if kind == "KCCL_KIND_CHOICE":
            choices[field] = {n: v for v, n in enumerate(names.split())}
            default = names.split()[_number(default)]
        elif kind != "KCCL_KIND_PATH":
            default = _number(default)
        settings.append(Setting(name, field, default, _parser(name, kind, names.split()), doc,
                                native=macro == "KCCL_SETTING", equal=equal))
    return tuple(settings), tuple(build), tuple(shim), choices


SETTINGS: Tuple[Setting, ...]
# BUILD_SETTINGS: read by setup.py (kccl/_build_cuda.py); NCCL_SETTINGS: by libkccl_nccl.so only,
# so a communicator of this package neither takes nor checks them.
SETTINGS, BUILD_SETTINGS, NCCL_SETTINGS, _CHOICES = _load()
ALGOS = _CHOICES["algo"]
DEBUG_LEVELS = _CHOICES["debug"]
SLOT_STORES = _CHOICES["slot_stores"]
TOPO_MODES = _CHOICES["topo"]
BY_NAME = {s.name: s for s in SETTINGS}
KNOWN_NAMES = (tuple(s.name for s in SETTINGS) + tuple(b[0] for b in BUILD_SETTINGS)
               + tuple(s.name for s in NCCL_SETTINGS))


def closest_setting(name):
    """The known variable nearest to `name` (itself when known; within 3 edits, and fewer
    than half the letters after KCCL_; the first in table order on a tie), else None:
    the C core's choice, the one its warning names."""
    near = _lib.kcclSettingClosest(str(name).encode())
    return _ffi.string(near).decode() if near != _ffi.NULL else None


def warn_unknown(environ=None):
    """The KCCL_* variables of the environment that are no setting.  For the process's
    own environment, the C core prints its one-line warning about them (once per process,
    and only on rank 0 where the launcher names the ranks: kcclSettingsWarnUnknown)."""
    if environ is None or environ is os.environ:
        _lib.kcclSettingsWarnUnknown()
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if k.startswith("KCCL_") and k not in KNOWN_NAMES)


def resolve(overrides: Optional[dict] = None, environ=None):
    """{name: (value, source)} for every setting; source is 'default', 'env' or 'override'.
    overrides may use the variable name (KCCL_TIMEOUT_MS) or the short field name (timeout_ms).
    Unknown KCCL_* variables of the environment are warned about (warn_unknown)."""
    environ = os.environ if environ is None else environ
    warn_unknown(environ)
    by_field = {s.field: s for s in SETTINGS}
    given = {}
    for key, val in (overrides or {}).items():
        s = BY_NAME.get(key) or by_field.get(key)
        if s is None:
            raise KcclInvalidArgument(f"unknown KCCL setting {key!r}; known: {', '.join(BY_NAME)}")
        given[s.name] = val
    out = {}
    for s in SETTINGS:
        if s.name in given:
            raw, src = given[s.name], "override"
        elif environ.get(s.name, "").strip(_BLANKS) != "":  # blank counts as unset, as in config.c
            raw, src = environ[s.name], "env"
        else:
            out[s.name] = (s.default, "default")
            continue
        out[s.name] = (s.parse(raw), src) if str(raw).strip(_BLANKS) else (s.default, src)
    return out


def native(ffi, overrides=None):
    """A filled kcclConfig_t* for kcclCommInitRankConfig."""
    return native_from(ffi, resolve(overrides))


def native_from(ffi, resolved):
    """The kcclConfig_t* of already resolved settings (Python-only ones left out)."""
    cfg = ffi.new("kcclConfig_t *")
    cfg.size = ffi.sizeof("kcclConfig_t")
    for name, (value, _src) in resolved.items():
        s = BY_NAME[name]
        if not s.native:
            continue
        if s.field in _CHOICES:  # a choice travels as its index
            value = _CHOICES[s.field][value]
        setattr(cfg, s.field, value)
    cfg.device = -1  # host transport unless the caller picks a GPU (Communicator(device=...))
    return cfg




def describe(environ=None) -> str:
    environ = os.environ if environ is None else environ
    rows = resolve(environ=environ)
    w = max(len(s.name) for s in SETTINGS + NCCL_SETTINGS)
    lines = [f"{'setting':<{w}}  {'value':>10}  {'source':<8}  meaning"]
    for s in SETTINGS:
        value, src = rows[s.name]
        lines.append(f"{s.name:<{w}}  {str(value):>10}  {src:<8}  {s.doc}")
    for name, default, doc in BUILD_SETTINGS:
        val = environ.get(name, "").strip()
        lines.append(f"{name:<{w}}  {val or default:>10}  {'env' if val else 'default':<8}  {doc}")
    for s in NCCL_SETTINGS:
        val = environ.get(s.name, "").strip()
        lines.append(f"{s.name:<{w}}  {val or s.default:>10}  {'env' if val else 'default':<8}  {s.doc}")
    return "\n".join(lines)


def main(argv=None):
    try:
        print(describe())
    except KcclInvalidArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
