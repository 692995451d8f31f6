"""The README and docs/ stay true: the README is a front page (at most 300 lines, linking
every docs page), the settings tables are the code's own tables, every relative link and
anchor resolves, every page starts by saying what a user does with it, and none tells the
project's history (that belongs in git)."""
import glob
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
DOCS = [README] + PAGES

# Words that tell how the project got here instead of what it is.
HISTORY = [r"\bthis round\b(?!'s)", r"\bsessions? \d", r"\bissues? #?\d", r"\bissue-\d", r"\bitems? \d",
           r"\bnext (\w+ )?(device|GPU) (call|run|session)", r"\bno longer\b", r"\bused to\b", r"\bpreviously\b",
           r"\b(is|are|was|were) now\b", r"\bnow (takes|checks|grown|remembered|refused|typed)\b",
           r"\bearlier (sessions?|rounds?|runs?|builds?|versions?)\b", r"\blater (issues?|sessions?|rounds?)\b",
           r"\b(all|was|were) fixed\b", r"\brefactors?\b", r"\bre-run\b", r"\bwhat it found\b"]


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _prose(text):
    """The text without fenced code blocks (commands may name anything)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def history_words(text):
    return [m.group(0) for pat in HISTORY for m in re.finditer(pat, _prose(text), re.I)]


def test_readme_is_a_front_page():
    text = _read(README)
    assert len(text.splitlines()) <= 300, len(text.splitlines())
    for heading in ("## Measured", "## Quick start", "## Chat with a model", "## Documentation", "## Not built yet"):
        assert heading in text, heading
    for page in PAGES:  # the docs map links every page
        assert f"(docs/{os.path.basename(page)})" in text, page


def test_settings_tables_are_generated_from_the_code():
    spec = importlib.util.spec_from_file_location("settings_tables", os.path.join(ROOT, "docs", "settings_tables.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = _read(mod.PAGE)
    assert mod.render(page) == page, "docs/settings.md differs from the settings tables: run python docs/settings_tables.py"
    from kccl import config
    from kie_engine import settings
    for name in [s.name for s in config.SETTINGS + config.NCCL_SETTINGS] + [b[0] for b in config.BUILD_SETTINGS] + \
            [s.name for s in settings.SETTINGS]:
        assert f"| `{name}` |" in page, name
    # and the check can fail: a table edited by hand is put back
    edited = page.replace("| `KCCL_TIMEOUT_MS` | 30000 |", "| `KCCL_TIMEOUT_MS` | 1000 |")
    assert edited != page and mod.render(edited) == page


def test_history_words_are_caught():
    assert history_words("The server (added this round) checks it, as session 13 found.") == ["this round", "session 1"]
    assert history_words("issue 33's fix, now remembered") == ["issue 3", "now remembered"]
    assert history_words("```\n# session 4\n```\nplain text") == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_history_words(path):
    assert history_words(_read(path)) == []


def _slug(heading):
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(path):
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", _prose(_read(path)), re.M)}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_links_resolve(path):
    here = os.path.dirname(path)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(_read(path))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(here, file)) if file else path
        if not os.path.exists(dest):
            bad.append(target)
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            bad.append(target)
    assert not bad, bad


@pytest.mark.parametrize("path", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_each_page_starts_with_what_a_user_does_with_it(path):
    lines = _read(path).splitlines()
    assert lines[0].startswith("# "), lines[0]
    first = next(ln for ln in lines[1:] if ln.strip())
    assert re.match(r"(Use|Read|Set|What) ", first), first
