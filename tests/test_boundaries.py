"""The boundaries the code claims, checked from its text: layers of the C core
(kccl_native/src/internal.h's list) and of its CUDA side (src/gpu/kgpu.h's list),
what code outside the core may include and call, cycles among Python modules,
and the public API that KIE, bench and KCCL's optional parts use.

Nothing is built or imported (except the one check that `import kccl` loads no
topology code): calls are found by reading function bodies, imports with ast."""
import ast
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "kccl_native")
SRC, GPU, INCLUDE = (os.path.join(NATIVE, d) for d in ("src", os.path.join("src", "gpu"), "include"))


def rel(path):
    return os.path.relpath(path, ROOT)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


# -- C and CUDA: what a file defines, and what it calls ---------------------------------------------

_LEX = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|[A-Za-z_]\w*|\S', re.S)
_IDENT = re.compile(r"[A-Za-z_]\w*")
_NOT_NAMES = {"if", "for", "while", "switch", "return", "sizeof", "__attribute__", "__launch_bounds__",
              "alignas", "decltype", "defined"}


def _tokens(text):
    """Tokens without comments; a string or character literal becomes '""'."""
    return ['""' if t[0] in "\"'" else t for t in _LEX.findall(text) if not t.startswith(("/*", "//"))]


def _split_preprocessor(text):
    """(code without preprocessor lines, the preprocessor lines): a macro's body counts as
    a use of what it calls, never as a definition."""
    code, pp, cont = [], [], False
    for line in text.split("\n"):
        is_pp = cont or line.lstrip().startswith("#")
        cont = is_pp and line.rstrip().endswith("\\")
        (pp if is_pp else code).append(line)
        if is_pp:
            code.append("")
    return "\n".join(code), "\n".join(pp)


def c_scan(text):
    """({function defined at file scope: (static?, identifiers its body uses)}, identifiers
    used inside any body or macro).  extern "C" { } and namespace { } are file scope; a
    declaration outside any body (a prototype) is no use."""
    code, pp = _split_preprocessor(text)
    toks = _tokens(code)
    defs, used, depth, stack, start, body = {}, set(), 0, [], 0, None
    for i, t in enumerate(toks):
        if t == "{":
            opens_scope = depth == 0 and ((i >= 2 and toks[i - 2] == "extern" and toks[i - 1] == '""')
                                          or "namespace" in toks[max(0, i - 2):i])
            if depth == 0 and not opens_scope:
                body = set()
                if toks[i - 1] == ")":
                    j, d = i - 1, 0
                    while j > 0:
                        d += (toks[j] == ")") - (toks[j] == "(")
                        if d == 0:
                            break
                        j -= 1
                    name = toks[j - 1]
                    if _IDENT.fullmatch(name) and name not in _NOT_NAMES:
                        defs[name] = ("static" in toks[start:j], body)
            stack.append(opens_scope)
            depth += not opens_scope
        elif t == "}":
            if stack and not stack.pop():
                depth -= 1
            if depth == 0:
                start = i + 1
        elif t == ";" and depth == 0:
            start = i + 1
        elif depth > 0 and _IDENT.fullmatch(t):
            used.add(t)
            body.add(t)
    used |= {t for t in _tokens(pp) if _IDENT.fullmatch(t)}
    return defs, used


def includes(text):
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M)


def layer_list(header):
    """[[file, ...], ...] lowest layer first, from a header's comment of the form
    '  N. file  what it does' (further files of layer N on lines of their own)."""
    head = read(header).split("*/", 1)[0]
    layers = []
    for line in head.splitlines():
        m = re.match(r"\s*\*\s+(?:(\d+)\.\s+)?(src/gpu/ or gpu_none\.c|[\w.]+\.(?:c|h|cu|cuh))\s", line + " ")
        if not m:
            continue
        if m.group(1):
            layers.append([])
        layers[-1].append(m.group(2))
    return layers


def owners(files):
    """{function: the file that defines it} for the functions other files may call: a
    source's non-static ones and a header's (inline) ones."""
    out = {}
    for f in files:
        defs, _used = c_scan(read(f))
        for name, (static, _body) in defs.items():
            if f.endswith((".h", ".cuh")) or not static:
                out.setdefault(name, f)
    return out


def calls(files, owner, through=()):
    """{(caller file, callee file): [functions]} over `files`.  A call of an inline function
    of a header in `through` counts as calls of what that function calls."""
    inline = {}
    for h in through:
        for name, (_static, body) in c_scan(read(h))[0].items():
            inline[name] = body
    out = {}
    for f in files:
        defs, used = c_scan(read(f))
        todo, seen = list(used - set(defs)), set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            g = owner.get(name)
            if g in through:
                todo += inline.get(name, ())
            elif g is not None and g != f:
                out.setdefault((f, g), []).append(name)
    return {k: sorted(v) for k, v in out.items()}


def check_layers(layers, group_of, files, owner, through=()):
    """Every call goes to a file listed before the caller's."""
    position = {}
    for pos, name in enumerate(n for layer in layers for n in layer):
        position[name] = pos
    broken = []
    for (a, b), names in calls(files, owner, through).items():
        ga, gb = group_of(a), group_of(b)
        if ga is None or gb is None or ga == gb:
            continue
        assert ga in position, f"{rel(a)} is not in the layer list"
        assert gb in position, f"{rel(b)} is not in the layer list"
        if position[gb] >= position[ga]:
            broken.append(f"{rel(a)} calls {rel(b)} (listed after it): {', '.join(names)}")
    return broken


def core_files():
    return sorted(glob.glob(os.path.join(SRC, "*.[ch]")))


def gpu_files():
    return sorted(f for f in glob.glob(os.path.join(GPU, "*")) if f.endswith((".cu", ".cuh", ".h")))


def core_group(path):
    """A file's entry in internal.h's list: a source is itself; a header belongs to the
    source of its name (replicas.h: replicas.c); src/gpu/ and gpu_none.c are one entry.
    The core's shared headers (internal.h, gpu_api.h) belong to no layer: their inline
    functions count as part of whoever calls them."""
    if os.path.dirname(path) == GPU or os.path.basename(path) == "gpu_none.c":
        return "src/gpu/ or gpu_none.c"
    name = os.path.basename(path)
    if name.endswith(".h"):
        src = name[:-2] + ".c"
        return src if os.path.exists(os.path.join(SRC, src)) else None
    return name


def test_core_layers_are_kept():
    layers = layer_list(os.path.join(SRC, "internal.h"))
    listed = {n for layer in layers for n in layer}
    assert {core_group(f) for f in core_files()} - {None} <= listed, "a source of src/ is missing from internal.h's list"
    # gpu_none.c stands in for src/gpu/ (same functions): the CUDA side owns them here
    files = core_files() + gpu_files()
    owner = owners([f for f in files if os.path.basename(f) != "gpu_none.c"])
    shared = [f for f in core_files() if core_group(f) is None]
    broken = check_layers(layers, core_group, files, owner, shared)
    assert not broken, "\n".join(broken)


def test_gpu_layers_are_kept():
    layers = layer_list(os.path.join(GPU, "kgpu.h"))
    assert {os.path.basename(f) for f in gpu_files()} == {n for layer in layers for n in layer}, \
        "src/gpu/kgpu.h's list and the files of src/gpu/ differ"
    broken = check_layers(layers, lambda f: os.path.basename(f) if os.path.dirname(f) == GPU else None,
                          gpu_files(), owners(gpu_files()))
    assert not broken, "\n".join(broken)


def test_layer_scanner_sees_a_break(tmp_path):
    """The checks above can fail: a lower file that calls a higher one is caught."""
    (tmp_path / "low.c").write_text("static int helper(void) { return 1; }\nint low(void) { return high() + helper(); }\n")
    (tmp_path / "shared.h").write_text("static inline int via(void) { return high(); }\n")
    (tmp_path / "high.c").write_text('extern "C" { int high(void) { return 2; } }\n#define H() low()\n')
    files = [str(tmp_path / "low.c"), str(tmp_path / "high.c")]
    owner = owners(files)
    assert owner == {"low": files[0], "high": files[1]}
    assert check_layers([["low.c"], ["high.c"]], os.path.basename, files, owner) == \
        [f"{rel(files[0])} calls {rel(files[1])} (listed after it): high"]
    # through a shared header's inline function
    (tmp_path / "low.c").write_text("int low(void) { return via(); }\n")
    shared = [str(tmp_path / "shared.h")]
    owner = owners(files + shared)
    assert check_layers([["low.c"], ["high.c"]], lambda f: None if f.endswith(".h") else os.path.basename(f),
                        files + shared, owner, shared) == [f"{rel(files[0])} calls {rel(files[1])} (listed after it): high"]


PUBLIC_HEADERS = {"kccl.h", "kccl_settings.def", "kccl_device.cuh", "kccl_launch.cuh"}


def test_include_holds_the_public_headers_and_marked_internals_only():
    """kccl_native/include/ is what the package installs: the public headers at its top,
    and kccl_device/, the device API's internals, which say so at their top."""
    top = {f for f in os.listdir(INCLUDE) if os.path.isfile(os.path.join(INCLUDE, f))}
    assert top == PUBLIC_HEADERS, top
    assert {d for d in os.listdir(INCLUDE) if os.path.isdir(os.path.join(INCLUDE, d))} == {"kccl_device"}
    assert "kccl_device/ (internal" in read(os.path.join(INCLUDE, "kccl_device.cuh"))
    for f in ("gpu_compat.h", "gpu_status.h"):
        assert "internal" in read(os.path.join(INCLUDE, "kccl_device", f)).split("*/", 1)[0].lower(), f


# The rooms outside the core that use KCCL: which of its public headers each may include,
# and which families of other libraries' headers (C, C++, POSIX and Linux headers are
# everyone's).  None may include anything else of KCCL's, nor name its internals, and each
# calls kccl.h's functions directly (it links libkccl.so), never through their addresses.
ROOMS = {
    "kccl_native/nccl": ({"kccl.h", "kccl_settings.def"}, {"cuda"}),
    "bench/native": ({"kccl.h", "kccl_device.cuh"}, {"cuda"}),
    "examples/c": ({"kccl.h"}, set()),
    "kie_engine/cpu/csrc": ({"kccl.h"}, set()),
    "kie_engine/gpu/csrc": ({"kccl.h", "kccl_device.cuh", "kccl_launch.cuh"}, {"cuda"}),
    "kccl/torch/csrc": ({"kccl.h"}, {"torch"}),
}
# Internals two of KCCL's own rooms may name: its benchmarks and device self-tests time and
# probe the device API from inside (kccl_device/: the kgpu_* flag primitives and clocks,
# kccl_detail's waits and traces); the NCCL shim is compiled with the core's defines
# (kccl/_build_lib.py), KCCL_HAVE_CUDA when the CUDA transport is in.
MAY_ALSO_NAME = {"bench/native": re.compile(r"(kgpu\w*|kccl_detail|KCCL_\w+)$"),
                 "kccl_native/nccl": re.compile(r"KCCL_HAVE_CUDA$")}
FAMILIES = {"cuda": re.compile(r"(cuda|cublas|nv|hip/)"), "torch": re.compile(r"(torch|ATen|c10|pybind11)/"),
            "mpi": re.compile(r"mpi\.h$")}


def test_every_room_outside_the_core_is_listed():
    rooms = {rel(os.path.dirname(f)) for pattern in ("kie_engine/*/csrc/*", "kccl/*/csrc/*")
             for f in glob.glob(os.path.join(ROOT, pattern))}
    assert rooms <= set(ROOMS), rooms - set(ROOMS)


def _defined_names(text):
    """Functions, macros, types and namespaces a file defines (at any depth for the last three)."""
    code, _pp = _split_preprocessor(text)
    names = set(c_scan(text)[0])
    names |= set(re.findall(r"^\s*#\s*define\s+(\w+)", text, re.M))
    names |= set(re.findall(r"\b(?:namespace|struct|class|enum)\s+(\w+)", code))
    names |= set(re.findall(r"\btypedef\b[^;{]*?(\w+)\s*;", code))
    names |= set(re.findall(r"\}\s*(\w+)\s*;", code))  # typedef struct { ... } name;
    return names


def kccl_h_names():
    """What kccl.h defines: its functions, types, enum values and macros."""
    text = read(os.path.join(INCLUDE, "kccl.h"))
    code, _pp = _split_preprocessor(text)
    names = set(re.findall(r"\b(kccl[A-Z]\w*|KCCL_[A-Z0-9_]+)\b", "\n".join(_tokens(code))))
    return names | set(re.findall(r"^\s*#\s*define\s+(KCCL_\w+)", text, re.M))


def kccl_h_functions():
    """The functions kccl.h declares."""
    toks = _tokens(_split_preprocessor(read(os.path.join(INCLUDE, "kccl.h")))[0])
    return {t for t, nxt in zip(toks, toks[1:]) if re.fullmatch(r"kccl[A-Z]\w*", t) and nxt == "("}


def public_kccl_names():
    """Names of KCCL's public form (kccl[A-Z]..., KCCL_...) that its public headers define or
    document; the kgpu*, kccl_* and kccl_detail names behind them are internals."""
    names = set()
    for h in PUBLIC_HEADERS:
        names |= set(re.findall(r"\b(kccl[A-Z]\w*|KCCL_[A-Z0-9_]+)\b", read(os.path.join(INCLUDE, h))))
    return names


_KCCL_FORM = re.compile(r"(kccl|KCCL|kgpu|KGPU)")


def room_breaks(folder):
    """What the files of a room do against the rules: includes, KCCL internals named, the
    core's functions called, kccl.h's names retyped."""
    d = os.path.join(ROOT, folder)
    own = {os.path.basename(f) for f in glob.glob(os.path.join(d, "*"))}
    kccl_headers, families = ROOMS[folder]
    all_kccl = PUBLIC_HEADERS | {"kccl_device/" + f for f in os.listdir(os.path.join(INCLUDE, "kccl_device"))}
    core = owners(core_files() + gpu_files())
    public, kccl_h = public_kccl_names(), {re.sub("_", "", n).lower(): n for n in kccl_h_names()}
    functions = kccl_h_functions()
    room_defs = set()
    files = [f for f in sorted(glob.glob(os.path.join(d, "*"))) if f.endswith((".c", ".h", ".cu", ".cuh", ".cpp"))]
    for f in files:
        room_defs |= _defined_names(read(f))
    bad = []
    for f in files:
        text = read(f)
        for quoted, h in re.findall(r'^\s*#\s*include\s+(["<])([^">]+)[">]', text, re.M):
            if h in all_kccl or h.startswith("kccl_device/"):
                ok = h in kccl_headers
            elif quoted == '"':
                ok = h in own
            else:
                ok = all(fam in families for fam, pattern in FAMILIES.items() if pattern.match(h))
            if not ok:
                bad.append(f"{rel(f)} includes {h}")
        defs, used = c_scan(text)
        bad += [f"{rel(f)} calls the core's {n}" for n in sorted(used - set(defs))
                if n in core and not re.match(r"kccl[A-Z]", n)]
        toks = _tokens(text)
        # a name pasted with ## is the start of one the room defines
        names = {t for t, nxt in zip(toks, toks[1:] + [""]) if _IDENT.fullmatch(t) and nxt != "#"}
        # a room links libkccl.so and calls kccl.h: a function named but not called is one taken
        # by its address, a member of that name one called through a table of such addresses
        bad += [f"{rel(f)} names kccl.h's {n} without calling it"
                for n in sorted({t for t, nxt in zip(toks, toks[1:] + [""]) if t in functions and nxt != "("})]
        bad += [f"{rel(f)} calls kccl.h's {n} through a pointer"
                for n in sorted({t for i, t in enumerate(toks) if t in functions and i >= 1
                                 and (toks[i - 1] == "." or toks[i - 2:i] == ["-", ">"])})]
        also = MAY_ALSO_NAME.get(folder)
        bad += [f"{rel(f)} names KCCL's internal {n}" for n in sorted(names - room_defs)
                if _KCCL_FORM.match(n) and n not in public and not (also and also.match(n))]
        for n in sorted(_defined_names(text)):
            twin = kccl_h.get(re.sub("_", "", n).lower())
            if twin:
                bad.append(f"{rel(f)} retypes kccl.h's {twin} as {n}")
    return bad


@pytest.mark.parametrize("folder", sorted(ROOMS))
def test_code_outside_the_core_uses_kccl_h_only(folder):
    """The NCCL shim, the benchmarks, the examples, KIE's engines and the torch backend
    include KCCL's public headers that their room may (ROOMS) or their own, call kccl.h's
    functions (directly, never through their addresses), never the core's kccl_* / kgpu_*
    helpers, name nothing of KCCL's internals, and take kccl.h's types and enums from kccl.h
    rather than spelling them again."""
    bad = room_breaks(folder)
    assert not bad, "\n".join(bad)


def test_room_rules_see_a_break(tmp_path, monkeypatch):
    """Each rule above can fail."""
    room = tmp_path / "room"
    room.mkdir()
    (room / "a.c").write_text('#include "kccl_device/gpu_compat.h"\n#include <torch/all.h>\n'
                              '#include "../other.h"\n#define KCCL_FLOAT32 7\n'
                              "int f(void) { return kgpu_launch_ex(0) + kccl_comm_rank(0); }\n"
                              "static void *table[] = {(void *)kcclAllReduce};\n"
                              "int g(struct api *a) { return a->kcclBarrier(0, 0); }\n")
    folder = rel(str(room))
    monkeypatch.setitem(ROOMS, folder, ({"kccl.h"}, set()))
    got = room_breaks(folder)
    for want in ("includes kccl_device/gpu_compat.h", "includes torch/all.h", "includes ../other.h",
                 "names KCCL's internal kgpu_launch_ex", "retypes kccl.h's kcclFloat32 as KCCL_FLOAT32",
                 "names kccl.h's kcclAllReduce without calling it", "calls kccl.h's kcclBarrier through a pointer"):
        assert any(want in b for b in got), (want, got)


# -- Python: imports ----------------------------------------------------------------------------------

def modules(package):
    """{module name: path} of a package's .py files."""
    base = os.path.join(ROOT, package)
    out = {}
    for path in glob.glob(os.path.join(base, "**", "*.py"), recursive=True):
        parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(path, module):
    """[(imported module or module.name, node)] of every import in the file, at any depth;
    relative ones resolved against `module`."""
    tree = ast.parse(read(path))
    is_pkg = os.path.basename(path) == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module
            out += [(f"{src}.{a.name}", node) for a in node.names]
    return out


def internal_edges(package):
    """{module: {module of the same package it imports}}: `from .x import y` is an edge to
    x, or to x.y when that is a module; the parent package that every import of a submodule
    runs first is left out."""
    mods = modules(package)
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        for target, _node in imports(path, m):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != m and not m.startswith(target + "."):
                edges[m].add(target)
    return edges


def cycles(edges):
    """Every strongly connected set of two or more modules (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", ["kccl", "kie_engine", "topology"])
def test_python_modules_import_no_cycle(package):
    found = cycles(internal_edges(package))
    assert not found, f"import cycles in {package}: {found}"


def reached(package, start):
    """The modules of `package` that `start` imports, directly or through others (imports at
    any depth, functions' included)."""
    edges = internal_edges(package)
    seen, todo = set(), [start]
    while todo:
        for w in edges.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


# KIE by job: what each group's modules may not reach.  Lane planning (what each lane holds)
# imports no model, so that every engine follows one plan without loading another's code;
# the native CPU engine does not load the numpy reference; file formats run no model.
KIE_MAY_NOT_REACH = {
    "kie_engine.lanes.plan": ("kie_engine.reference", "kie_engine.cpu", "kie_engine.gpu", "kie_engine.serve"),
    "kie_engine.cpu.engine": ("kie_engine.reference", "kie_engine.gpu", "kie_engine.serve"),
    "kie_engine.formats": ("kie_engine.reference", "kie_engine.lanes", "kie_engine.cpu", "kie_engine.gpu",
                           "kie_engine.serve", "kie_engine.generate"),
}


@pytest.mark.parametrize("start", sorted(KIE_MAY_NOT_REACH))
def test_kie_groups_import_only_below_them(start):
    starts = [m for m in modules("kie_engine") if m == start or m.startswith(start + ".")]
    assert starts, start
    bad = sorted({f"{m} reaches {r}" for m in starts for r in reached("kie_engine", m)
                  if any(r == f or r.startswith(f + ".") for f in KIE_MAY_NOT_REACH[start])})
    assert not bad, "\n".join(bad)


def test_kie_top_level_is_grouped():
    """kie_engine's top level holds the CLI, the decode loop, errors and settings; the rest
    lives in its group (formats, reference, lanes) or engine (cpu, gpu, serve)."""
    top = {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "kie_engine", "*.py"))}
    assert top == {"__init__", "__main__", "errors", "settings", "generate", "perplexity"}, top


def test_reach_finder_sees_imports_inside_functions():
    """lanes/backend.py builds the backends (its imports of them are inside load_backend):
    the finder sees them, so a plan that imported the backends would fail above."""
    got = reached("kie_engine", "kie_engine.lanes.backend")
    assert {"kie_engine.reference.sharded", "kie_engine.reference.model", "kie_engine.cpu.engine"} <= got, got


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def kccl_public():
    """What code outside kccl may use: the names kccl/__init__.py exports, and the
    modules kccl.capi, kccl.paths, kccl.errors, kccl.config (the settings registry behind
    `python -m kccl.config`) and kccl.torch (its submodules too)."""
    tree = ast.parse(read(os.path.join(ROOT, "kccl", "__init__.py")))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            names = set(ast.literal_eval(node.value))
    return names | {"__version__", "VERSION_CODE"}, ("kccl.capi", "kccl.paths", "kccl.errors", "kccl.config",
                                                     "kccl.torch")


def kccl_private_attributes():
    """Attribute names that only kccl's own classes use: self._x of any class in kccl/
    and its methods that start with an underscore (comm._handle(), comm._buffers)."""
    names = set()
    for path in modules("kccl").values():
        for node in ast.walk(ast.parse(read(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                names |= {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and f.name.startswith("_") and not f.name.startswith("__")}
    return names


def kccl_uses(paths, own_attributes=frozenset()):
    """What files outside kccl use of it beyond its public API."""
    names, public_modules = kccl_public()
    private = kccl_private_attributes() - set(own_attributes)
    bad = []
    for path in paths:
        text = read(path)
        for target, node in imports(path, "__outside__"):
            where = f"{rel(path)}:{node.lineno}"
            if target == "kccl" or not target.startswith("kccl."):
                continue
            if any(target == m or target.startswith(m + ".") for m in public_modules):
                continue
            # a native build (bench/native/build.py, ...) compiles as KCCL's own does
            if target.startswith("kccl._build_cuda") and re.match(r"_?build", os.path.basename(path)):
                continue
            mod, _, name = target.rpartition(".")
            if isinstance(node, ast.ImportFrom) and mod == "kccl" and (name in names or f"kccl.{name}" in public_modules):
                continue
            bad.append(f"{where} imports {target}")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Attribute):
                continue
            where = f"{rel(path)}:{node.lineno}"
            if isinstance(node.value, ast.Name) and node.value.id == "kccl" and node.attr.startswith("_") \
                    and node.attr not in ("__version__",):
                bad.append(f"{where} uses kccl.{node.attr}")
            elif node.attr in private and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                bad.append(f"{where} uses .{node.attr} of a kccl object")
    return bad


def _own_private_attributes(paths):
    """self._x names a set of files defines for itself (so KIE's own engine._handle() is not
    taken for a kccl communicator's)."""
    own = set()
    for path in paths:
        for node in ast.walk(ast.parse(read(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
    return own


def _py_files(*folders):
    out = []
    for folder in folders:
        out += glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)
    return sorted(p for p in out if "_build" + os.sep not in p)


@pytest.mark.parametrize("folder", ["kie_engine", "bench"])
def test_users_of_kccl_take_its_public_api(folder):
    """KIE (the CUDA engine and the native CPU engine included) and the benchmarks reach
    KCCL through its public API only (kccl_public): no kccl._native, no comm._handle();
    their build scripts may share KCCL's nvcc rules (kccl._build_cuda)."""
    paths = _py_files(folder)
    bad = kccl_uses(paths, _own_private_attributes(paths))
    assert not bad, "\n".join(bad)


def test_public_api_check_sees_a_reach_inside(tmp_path):
    p = tmp_path / "user.py"
    p.write_text("import kccl\nfrom kccl._native import lib\nfrom kccl import capi, Communicator\n"
                 "from kccl.errors import KcclError\nh = comm._handle()\nx = kccl._lib\n")
    bad = kccl_uses([str(p)])
    assert sorted(b.split(" ", 1)[1] for b in bad) == ["imports kccl._native.lib", "uses ._handle of a kccl object",
                                                       "uses kccl._lib"], bad


def test_bench_takes_no_private_kie_module():
    bad = []
    for path in _py_files("bench"):
        for target, node in imports(path, "__outside__"):
            if target.startswith("kie_engine.") and any(p.startswith("_") for p in target.split(".")[1:]):
                bad.append(f"{rel(path)}:{node.lineno} imports {target}")
    assert not bad, "\n".join(bad)


def test_topology_is_imported_only_when_a_communicator_is_made():
    """topology (sysfs, NVML, the placement model) costs import time that a plain
    communicator does not need: kccl imports it only inside kccl/placement.py's functions,
    which Communicator's init calls, and nothing else imports it at module level."""
    bad = []
    for package in ("kccl", "kie_engine"):
        for m, path in modules(package).items():
            tree = ast.parse(read(path))
            top = {id(n) for n in tree.body}
            for target, node in imports(path, m):
                if target.split(".")[0] != "topology":
                    continue
                if id(node) in top or rel(path) != os.path.join("kccl", "placement.py"):
                    bad.append(f"{rel(path)}:{node.lineno} imports {target}")
    assert not bad, "\n".join(bad)
    probe = "import sys, kccl, kie_engine; print(sorted(m for m in sys.modules if m.split('.')[0] == 'topology'))"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout
