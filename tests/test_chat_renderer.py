"""The chat template's renderer process (kie_engine/formats/bounded.py Worker, kie_engine/formats/chat.py):
forked once per template and reused, not forked per render (a fork from a server with
torch loaded cost ~80 ms of every request's time to first token); still bounded, and it
leaves nothing behind.  The hostile templates themselves: tests/test_fuzz_chat.py."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("jinja2")

from kie_engine.formats.chat import ChatTemplate, ChatTemplateError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ECHO = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
LOOP = "{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}" \
       "{% endfor %}{% endfor %}{% endif %}" + ECHO
HUGE = "{% if messages[0].content == 'huge' %}{{ 'x' * 10000000000 }}{% endif %}" + ECHO


def _user(text):
    return [{"role": "user", "content": text}]


def _gone(pid, within=5.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":  # a zombie: ended, not yet reaped
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_one_process_renders_every_request(monkeypatch):
    forks = []
    real_fork = os.fork

    def counting_fork():
        forks.append(1)
        return real_fork()
    monkeypatch.setattr(os, "fork", counting_fork)
    t = ChatTemplate(ECHO, source="T.jinja")
    try:
        outs = [t.render(_user(f"m{i}")) for i in range(5)]
        assert outs == [f"[user:m{i}]>" for i in range(5)]
        assert t.render(_user("x"), add_generation_prompt=False) == "[user:x]"
        assert len(forks) == 1  # before: one fork per render
    finally:
        t.close()


def test_an_overrun_ends_the_renderer_and_the_next_render_gets_a_fresh_one():
    t = ChatTemplate(LOOP, source="T.jinja")
    t.time_limit = 1.0
    try:
        assert t.render(_user("a")) == "[user:a]>"
        first = t._worker.pid
        t0 = time.monotonic()
        with pytest.raises(ChatTemplateError, match="did not finish within 1 s"):
            t.render(_user("loop"))
        assert time.monotonic() - t0 < 5
        assert _gone(first)
        assert t.render(_user("b")) == "[user:b]>" and t._worker.pid not in (0, first)
    finally:
        t.close()


def test_out_of_memory_ends_the_renderer_and_the_next_render_works():
    t = ChatTemplate(HUGE, source="T.jinja")
    try:
        assert t.render(_user("a")) == "[user:a]>"
        first = t._worker.pid
        with pytest.raises(ChatTemplateError, match="memory"):
            t.render(_user("huge"))
        assert _gone(first)
        assert t.render(_user("b")) == "[user:b]>"
    finally:
        t.close()


def test_errors_leave_the_renderer_running():
    t = ChatTemplate("{{ raise_exception('no ' ~ messages[0].content) }}", source="T.jinja")
    try:
        with pytest.raises(ChatTemplateError, match="rendering failed: no a"):
            t.render(_user("a"))
        pid = t._worker.pid
        with pytest.raises(ChatTemplateError, match="rendering failed: no b"):
            t.render(_user("b"))
        assert t._worker.pid == pid
    finally:
        t.close()
    with pytest.raises(ChatTemplateError, match="not plain JSON"):
        ChatTemplate(ECHO).render([{"role": "user", "content": object()}])


def test_concurrent_renders_each_get_their_own_answer():
    t = ChatTemplate(ECHO, source="T.jinja")
    out, errors = {}, []

    def go(i):
        try:
            for k in range(10):
                out[(i, k)] = t.render(_user(f"{i}.{k}"))
        except Exception as e:  # pragma: no cover (reported below)
            errors.append(e)
    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t.close()
    assert not errors
    assert out == {(i, k): f"[user:{i}.{k}]>" for i in range(6) for k in range(10)}


def test_the_renderer_keeps_no_inherited_descriptor_and_ends_with_its_template():
    keep_open = open(os.devnull)
    try:
        t = ChatTemplate(ECHO, source="T.jinja")
        t.render(_user("a"))
        pid = t._worker.pid
        fds = os.listdir(f"/proc/{pid}/fd")
        assert keep_open.fileno() not in [int(fd) for fd in fds]
        assert len(fds) <= 5, fds  # stdin/out/err and its two pipes
        del t  # dropping the template ends its renderer and reaps it
        assert _gone(pid, within=2.0)
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    finally:
        keep_open.close()


def test_a_renderer_busy_when_its_parent_dies_ends_too():
    code = ("import sys, threading; from kie_engine.formats.chat import ChatTemplate; "
            f"t = ChatTemplate({LOOP!r}); t.time_limit = 600; "
            "t.render([{'role': 'user', 'content': 'a'}]); print(t._worker.pid, flush=True); "
            "t.render([{'role': 'user', 'content': 'loop'}])")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(p.stdout.readline())
        time.sleep(0.5)  # inside the endless render now
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        assert _gone(child, within=5.0)
    finally:
        p.kill()
        p.wait()


def test_a_forked_copy_of_the_process_renders_with_its_own_renderer_and_leaves_the_owners_alone():
    t = ChatTemplate(ECHO, source="T.jinja")
    try:
        t.render(_user("a"))
        owner_renderer = t._worker.pid
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the forked copy)
            ok = 0
            try:
                ok = t.render(_user("child")) == "[user:child]>" and t._worker.pid not in (0, owner_renderer)
                t._worker._finalizer()  # what its exit would run: must not end the owner's renderer
            finally:
                os.write(w, b"1" if ok else b"0")
                os._exit(0)
        os.close(w)
        answer = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert answer == b"1"
        assert t._worker.pid == owner_renderer and t.render(_user("b")) == "[user:b]>"
    finally:
        t.close()
