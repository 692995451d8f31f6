"""The settings tables of docs/settings.md, written from the tables themselves so that the
page cannot drift: KCCL's from kccl_native/include/kccl_settings.def (through kccl.config,
which parses it) and KIE's from kie_engine/settings.py.

    python docs/settings_tables.py           # rewrites the tables in docs/settings.md
    python docs/settings_tables.py --check   # exit status 1 when the page differs (tests/test_docs.py)

Each table sits between a BEGIN and an END marker line; the text around them is the page's."""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "settings.md")
DEF = os.path.join(ROOT, "kccl_native", "include", "kccl_settings.def")
MARK = "<!-- {} GENERATED {} by docs/settings_tables.py: edit the source table, then run it -->"


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def _size(v):
    for unit, shift in (("M", 20), ("K", 10)):
        if v and v % (1 << shift) == 0:
            return f"{v >> shift}{unit}"
    return str(v)


def kccl_table():
    sys.path.insert(0, ROOT)
    from kccl import config
    with open(DEF) as f:
        kinds = {args[1] if macro != "KCCL_BUILD_SETTING" else args[0]: args[2] if macro != "KCCL_BUILD_SETTING" else ""
                 for macro, args in config.parse_table(f.read())}
    equal = {"KCCL_EQUAL_ALL": "yes", "KCCL_EQUAL_GPU": "GPU ranks", "KCCL_EQUAL_NO": ""}

    def default(name, v):
        if kinds.get(name) == "KCCL_KIND_SIZE":
            return _size(v)
        return "(none)" if v == "" else str(v)
    rows = ["| variable | default | read by | equal on all ranks | meaning |", "|---|---|---|---|---|"]
    for s in config.SETTINGS:
        who = "C core and Python" if s.native else "Python"
        rows.append(f"| `{s.name}` | {_cell(default(s.name, s.default))} | {who} | {equal[s.equal]} | {_cell(s.doc)} |")
    for s in config.NCCL_SETTINGS:
        rows.append(f"| `{s.name}` | {_cell(default(s.name, s.default))} | NCCL shim | | {_cell(s.doc)} |")
    for name, dflt, doc in config.BUILD_SETTINGS:
        rows.append(f"| `{name}` | {_cell(dflt or '(none)')} | install / tests | | {_cell(doc)} |")
    return "\n".join(rows)


def kie_table():
    sys.path.insert(0, ROOT)
    from kie_engine import settings

    def values(s):
        if s.kind == "flag":
            return "0 or 1"
        if s.kind == "count":
            return "a whole number >= 1"
        if s.kind == "choice":
            return ", ".join(s.values)
        if s.kind == "names":
            return "some of " + ", ".join(s.values) + ", comma-separated"
        if s.values:
            return ", ".join(map(str, s.values))
        return f"{s.lo}..{s.hi}"

    rows = ["| variable | default | values | meaning |", "|---|---|---|---|"]
    for s in settings.SETTINGS:
        d = "auto" if s.default is None else "(none)" if s.default == "" else s.default
        rows.append(f"| `{s.name}` | {_cell(d)} | {_cell(values(s))} | {_cell(s.doc)} |")
    return "\n".join(rows)


TABLES = {"KCCL": kccl_table, "KIE": kie_table}


def render(page_text):
    """page_text with every generated table rewritten."""
    for name, make in TABLES.items():
        begin, end = MARK.format("BEGIN", name), MARK.format("END", name)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)
        if len(pattern.findall(page_text)) != 1:
            raise SystemExit(f"{PAGE}: expected one {name} table between\n{begin}\nand\n{end}")
        page_text = pattern.sub(lambda _m: f"{begin}\n{make()}\n{end}", page_text)
    return page_text


def main(argv):
    with open(PAGE) as f:
        old = f.read()
    new = render(old)
    if "--check" in argv:
        if new != old:
            print(f"{PAGE} differs from the settings tables: run python docs/settings_tables.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        with open(PAGE, "w") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
