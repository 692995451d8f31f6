"""Fuzzing chat templates (kie_engine/formats/chat.py) and the conversations they render.

A template comes with the checkpoint, so it is untrusted code: whatever it is, rendering
gives text or a ChatTemplateError naming the template's source, within the template's
time limit, without reading files or reaching Python internals.  Hostile templates by
hand (endless loops, recursion, huge strings and numbers, file access, sandbox escapes),
templates assembled from random jinja2 fragments, and random conversations (any text,
wrong types) through a real ChatML template.

Run longer: HYPOTHESIS_PROFILE=fuzz-long (see tests/_fuzz.py)."""
import time

import pytest
from hypothesis import given, strategies as st

pytest.importorskip("jinja2")

from _fuzz import bounded, examples  # noqa: E402
from kie_engine.formats.chat import ChatTemplate, ChatTemplateError  # noqa: E402

LIMIT = 2.0  # seconds a test template may take (the engine's default is ChatTemplate.time_limit)

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

HOSTILE = {
    "nested_ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "macro_fanout": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "macro_recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "string_repeat": "{{ 'x' * 10000000000 }}",
    "string_center": "{{ 'x'.center(10000000000) }}",
    "filter_center": "{{ 'x' | center(10000000000) }}",
    "format_width": "{{ '%10000000000d' % 1 }}",
    "big_power": "{{ 10 ** (10 ** 10) }}",
    "namespace_doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s | length }}",
    "list_doubling": "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                     "{% endfor %}{{ ns.l | length }}",
    "range_list": "{{ range(10 ** 12) | list }}",
    "deep_parens": "{{ " + "(" * 20000 + "1" + ")" * 20000 + " }}",
    "deep_blocks": "{% if 1 %}" * 3000 + "x" + "{% endif %}" * 3000,
    "divide_by_zero": "{{ 1 / 0 }}",
    "include": "{% include '/etc/passwd' %}",
    "import": "{% import '/etc/passwd' as p %}",
    "open": "{{ open('/etc/passwd').read() }}",
    "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals": "{{ raise_exception.__globals__['os'].popen('id').read() }}",
    "cycler": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "self": "{{ self.__init__.__globals__.__builtins__.open('/etc/passwd').read() }}",
    "lipsum_globals": "{{ lipsum.__globals__['os'].listdir('/') }}",
    "format_attr": "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
    "mutate": "{{ messages.append(1) }}{{ messages.clear() }}",
    "tojson_cycle": "{% set d = {} %}{{ d | tojson(indent=10 ** 9) }}",
    "unclosed": "{% for m in messages %}",
    "bad_syntax": "{{ }}{% %}",
}
# Harmless though odd: text or an error, both fine.
ODD = {"index": "{{ messages[10 ** 9] }}", "strftime": "{{ strftime_now('%Q' * 100000) }}",
       "undefined": "{{ nothing.at.all }}", "loop_vars": "{% for m in messages %}{{ loop.cycle(1, 2) }}{% endfor %}"}


def _render(template, messages=({"role": "user", "content": "hi"},)):
    t = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"}, source="T.jinja")
    t.time_limit = LIMIT
    start = time.monotonic()
    try:
        with bounded(LIMIT + 20):
            out = t.render(list(messages))
    except ChatTemplateError as e:
        assert str(e).startswith("T.jinja: "), str(e)
        out = e
    assert time.monotonic() - start < LIMIT + 10
    return out


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_are_stopped(name):
    out = _render(HOSTILE[name])
    assert isinstance(out, ChatTemplateError), (name, str(out)[:200])
    assert "root:" not in str(out) and "uid=" not in str(out)


@pytest.mark.parametrize("name", sorted(ODD))
def test_odd_templates(name):
    _render(ODD[name])


def test_stopped_says_why():
    assert "did not finish within" in str(_render(HOSTILE["nested_ranges"]))
    assert "memory" in str(_render(HOSTILE["string_repeat"]))
    assert "does not compile" in str(_render(HOSTILE["unclosed"]))
    assert "rendering failed: ZeroDivisionError" in str(_render(HOSTILE["divide_by_zero"]))


def test_chatml_renders():
    out = _render(CHATML, [{"role": "user", "content": "Zürich {{ 1 }} {% raw %}"}])
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n<|im_start|>user\n"
                   "Zürich {{ 1 }} {% raw %}<|im_end|>\n<|im_start|>assistant\n")


FRAGMENTS = [
    "{{ messages }}", "{{ messages[0]['content'] }}", "{% for m in messages %}", "{% endfor %}", "{% if ",
    "add_generation_prompt", " %}", "{% else %}", "{% endif %}", "{{ ", " }}", "m['role']", "m.content", " ~ ",
    " + ", " * ", " ** ", "9999999", "range(", ")", "(", "'x'", "|length", "|tojson", "|upper", "|join(',')",
    "{% set x = ", "{% set ns = namespace(a=1) %}", "ns.a", "{% macro f(n) %}", "{% endmacro %}", "f(3)",
    "{% break %}", "{% continue %}", "loop.index", "raise_exception('no')", "bos_token", "eos_token",
    "{# c #}", "{% raw %}", "{% endraw %}", "[", "]", "{", "}", ":", ",", ".__class__", "\n", "text ",
    "{%- ", " -%}", "strftime_now('%Y')", "namespace", "lipsum", "cycler", "joiner", "dict(a=1)",
]


@examples(100)
@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=8), max_size=24))
def test_random_templates(parts):
    out = _render("".join(parts))
    assert isinstance(out, (str, ChatTemplateError))


messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": st.text()}),
    st.dictionaries(st.sampled_from(["role", "content", "x"]), st.text() | st.integers() | st.none(), max_size=3),
    st.text(max_size=5), st.integers(), st.none()), max_size=5)


@examples(50)
@given(messages)
def test_random_conversations(msgs):
    out = _render(CHATML, msgs)
    if isinstance(out, str):
        for m in msgs:
            assert m["content"] in out
