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

from .errors import KcclInvalidArgument

# What config.c strips around a value (C's isspace), and the longest value it reads:
# both parsers must take and refuse the same strings.
_BLANKS = " \t\n\v\f\r"
_MAX_LEN = 255


def _clean(text):
    s = str(text).strip(_BLANKS)
    if len(s) > _MAX_LEN:
        raise ValueError(f"{len(s)} characters, longer than any value it takes")
    return s


def _int_range(lo, hi, sizes=False, multiple=1):
    def parse(text):
        s = _clean(text)
        mult = 1
        if sizes and s[-1:] in "kKmM" and s[:-1]:
            mult = 1024 if s[-1] in "kK" else 1024 * 1024
            s = s[:-1]
        if not re.fullmatch(r"[+-]?[0-9]+", s):  # what C's strtol takes, nothing more
            raise ValueError(f"expected an integer{' (k/M suffix allowed)' if sizes else ''}")
        v = int(s) * mult
        if not lo <= v <= hi:
            raise ValueError(f"expected a value in [{lo}, {hi}]")
        if v % multiple:
            raise ValueError(f"expected a multiple of {multiple}")
        return v
    return parse


def _choice(table):
    def parse(text):
        s = _clean(text)
        for name, v in table.items():
            if s.lower() == name.lower() or s == str(v):
                return name
        raise ValueError(f"expected one of {', '.join(table)}")
    return parse


def _path(text):
    s = str(text).strip()
    if not s:
        raise ValueError("expected a file path")
    return s


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
                                _path if kind == "KCCL_KIND_PATH" else _int_range(_number(lo), _number(hi),
                                                                                  sizes=kind == "KCCL_KIND_SIZE"),
                                doc, native=False))
            continue
        else:
            (field, name, kind, default, names, doc), lo, hi, multiple, equal = args, None, None, "1", "KCCL_EQUAL_NO"
        if kind == "KCCL_KIND_CHOICE":
            table = {n: v for v, n in enumerate(names.split())}
            choices[field] = table
            parse, default = _choice(table), names.split()[_number(default)]
        elif kind == "KCCL_KIND_PATH":
            parse = _path
        elif macro == "KCCL_PY_SETTING":  # a byte count (the entry has no range of its own)
            parse, default = _int_range(0, 1 << 40, sizes=True), _number(default)
        else:
            parse = _int_range(_number(lo), _number(hi), sizes=kind == "KCCL_KIND_SIZE", multiple=_number(multiple))
            default = _number(default)
        settings.append(Setting(name, field, default, parse, doc, native=macro == "KCCL_SETTING", equal=equal))
    return tuple(settings), tuple(build), tuple(shim), choices


SETTINGS: Tuple[Setting, ...]
# BUILD_SETTINGS: read by setup.py (kccl/_build_cuda.py); NCCL_SETTINGS: by libkccl_nccl.so only,
# so a communicator of this package neither takes nor checks them.
SETTINGS, BUILD_SETTINGS, NCCL_SETTINGS, _CHOICES = _load()
ALGOS = _CHOICES["algo"]
DEBUG_LEVELS = _CHOICES["debug"]
TOPO_MODES = _CHOICES["topo"]
BY_NAME = {s.name: s for s in SETTINGS}
KNOWN_NAMES = (tuple(s.name for s in SETTINGS) + tuple(b[0] for b in BUILD_SETTINGS)
               + tuple(s.name for s in NCCL_SETTINGS))


class KcclSettingWarning(UserWarning):
    """A KCCL_* environment variable that is no KCCL setting (a misspelling is otherwise
    ignored without a word)."""


def _edit_distance(a, b):
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        diag, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            diag, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diag + (ca != cb))
    return row[-1]


def closest_setting(name):
    """The known variable nearest to `name` (within 3 edits, and fewer than half the
    letters after KCCL_; the first in registry order on a tie), else None."""
    best, best_d = None, 4
    for known in KNOWN_NAMES:
        d = _edit_distance(name, known)
        if d < best_d and 2 * d < len(name) - 5:
            best, best_d = known, d
    return best


_warned = set()


def warn_unknown(environ=None):
    """Warns (KcclSettingWarning), once per process and name, about every KCCL_* variable
    that is not a setting; returns those names."""
    import warnings
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith("KCCL_") and k not in KNOWN_NAMES)
    for name in unknown:
        if name in _warned:
            continue
        _warned.add(name)
        near = closest_setting(name)
        hint = f"; did you mean {near}?" if near else ""
        warnings.warn(f"{name} is not a KCCL setting and is ignored{hint} (python -m kccl.config lists them)",
                      KcclSettingWarning, stacklevel=3)
    return unknown


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
        try:
            out[s.name] = (s.parse(raw), src)
        except ValueError as e:
            raise KcclInvalidArgument(f"{s.name}={raw!r}: {e}") from None
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
