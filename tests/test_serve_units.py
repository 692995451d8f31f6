"""The server's parts without a model or HTTP: stop strings held back across pieces
(hypothesis against str.find), request validation, the Prometheus histogram, the engine
runner's early stop over generate(), and the scheduler's FIFO queue, 429, cancellation
and shutdown with a stand-in model."""
import asyncio
import time

import numpy as np
import pytest
from hypothesis import given, strategies as st

pytest.importorskip("starlette")
pytest.importorskip("tokenizers")

from kie_engine.generate import Sampling  # noqa: E402
from kie_engine.serve.api_error import ApiError  # noqa: E402
from kie_engine.serve.engine_runner import EngineRunner  # noqa: E402
from kie_engine.serve.metrics import Histogram, Metrics  # noqa: E402
from kie_engine.serve.scheduler import Job, Scheduler  # noqa: E402
from kie_engine.serve.schemas import check_context, parse_chat, parse_completion, parse_json  # noqa: E402
from kie_engine.serve.text import StopMatcher  # noqa: E402
from kie_engine.formats.tokenizer import byte_level_tokenizer  # noqa: E402


# -- stop strings ------------------------------------------------------------------------
def _cut(text, stops):
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


@given(st.lists(st.text("abc", max_size=4), max_size=12),
       st.lists(st.text("abc", min_size=1, max_size=4), max_size=3))
def test_stop_matcher_equals_cutting_the_whole_text(pieces, stops):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    assert (out, m.hit) == _cut("".join(pieces), stops)


@given(st.lists(st.text("ab", max_size=3), max_size=10), st.text("ab", min_size=1, max_size=4))
def test_stop_matcher_never_gives_out_a_stop_prefix_too_early(pieces, stop):
    """What is given out after each piece is a prefix of the final text: nothing is
    taken back (a stream cannot unsend)."""
    m = StopMatcher([stop])
    final, _ = _cut("".join(pieces), [stop])
    sent = ""
    for p in pieces:
        sent += m.feed(p)
        assert final.startswith(sent)


def test_stop_matcher_holds_back_only_what_may_become_a_stop():
    m = StopMatcher(["\n\nUser:"])
    assert m.feed("Hello\n") == "Hello"
    assert m.feed("\nUs") == ""
    assert m.feed("ual") == "\n\nUsual"
    assert m.feed(" end\n\nUser: more") == " end" and m.hit
    assert m.feed("anything") == "" and m.flush() == ""


# -- validation --------------------------------------------------------------------------
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _chat(**kw):
    return parse_chat({**CHAT, **kw}, "m")


def test_chat_defaults_and_fields():
    r = _chat()
    assert (r.temperature, r.top_p, r.top_k, r.seed, r.stop, r.stream, r.max_tokens) == \
        (1.0, 1.0, 0, None, [], False, None)
    r = _chat(max_tokens=5, max_completion_tokens=7, temperature=0, top_p=0.5, top_k=-1, seed=2**64 - 1, stop="x",
              stream=True, stream_options={"include_usage": True}, ignore_eos=True, user="u", n=1)
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed, r.stop, r.include_usage, r.ignore_eos) == \
        (7, 0.0, 0.5, 0, 2**64 - 1, ["x"], True, True)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = _chat(messages=[{"role": "developer", "content": parts},
                        {"role": "assistant", "content": None}, {"role": "user", "content": "q"}])
    assert r.messages == [{"role": "system", "content": "ab"}, {"role": "assistant", "content": ""},
                          {"role": "user", "content": "q"}]


@pytest.mark.parametrize("kw,status,param", [
    ({"model": "other"}, 404, "model"), ({"model": 3}, 400, "model"), ({"n": 2}, 400, "n"),
    ({"temperature": "hot"}, 400, "temperature"), ({"temperature": 2.5}, 400, "temperature"),
    ({"temperature": True}, 400, "temperature"), ({"top_p": 0}, 400, "top_p"), ({"top_p": 1.5}, 400, "top_p"),
    ({"top_k": -2}, 400, "top_k"), ({"top_k": 1.5}, 400, "top_k"), ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 2.0}, 400, "max_tokens"), ({"max_completion_tokens": "9"}, 400, "max_completion_tokens"),
    ({"seed": 1.5}, 400, "seed"), ({"seed": -1}, 400, "seed"), ({"seed": 2**64}, 400, "seed"),
    ({"stop": 3}, 400, "stop"), ({"stop": [""]}, 400, "stop"),
    ({"stop": ["a"] * 17}, 400, "stop"), ({"stream": "yes"}, 400, "stream"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"stream": True, "stream_options": []}, 400, "stream_options"), ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"), ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ({"messages": ["hi"]}, 400, "messages[0]"), ({"logprobs": True}, 400, "logprobs"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"), ({"tools": [{"type": "function"}]}, 400, "tools"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"), ({"ignore_eos": 1}, 400, "ignore_eos")])
def test_chat_refusals_name_the_parameter(kw, status, param):
    with pytest.raises(ApiError) as e:
        _chat(**kw)
    assert (e.value.status, e.value.param) == (status, param)
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_missing_fields_and_no_ops():
    for body, param in (({"messages": CHAT["messages"]}, "model"), ({"model": "m"}, "messages")):
        with pytest.raises(ApiError, match="required") as e:
            parse_chat(body, "m")
        assert e.value.param == param
    _chat(presence_penalty=0, logprobs=False, tools=[], tool_choice="none", response_format={"type": "text"})


def test_completion_prompts():
    p = lambda prompt, **kw: parse_completion({"model": "m", "prompt": prompt, **kw}, "m", 100).prompt  # noqa: E731
    assert p("x") == "x" and p(["x"]) == "x" and p([1, 2]) == [1, 2] and p([[3]]) == [3]
    for bad, what in (([], "empty"), (["a", "b"], "one per request"), ([1, 100], "outside"), ([1, True], "token ids"),
                      (5, "token ids")):
        with pytest.raises(ApiError, match=what):
            p(bad)
    for kw in ({"echo": True}, {"best_of": 2}, {"suffix": "x"}, {"logprobs": 2}):
        with pytest.raises(ApiError, match="not supported"):
            p("x", **kw)


def test_json_and_context():
    for raw in (b"{bad", b"[1]", b"\xff", b'{"temperature": NaN}', b"null", b"[" * 100_000 + b"]" * 100_000,
                b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        with pytest.raises(ApiError) as e:
            parse_json(raw)
        assert e.value.status == 400 and e.value.code == "invalid_json"
    assert check_context(10, None, 100) == 90 and check_context(10, 90, 100) == 90
    with pytest.raises(ApiError, match="100 tokens.*101 tokens \\(10 in the prompt, 91") as e:
        check_context(10, 91, 100)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(ApiError, match="no room"):
        check_context(100, None, 100)


# -- metrics -----------------------------------------------------------------------------
def test_histogram_is_cumulative():
    h = Histogram((0.1, 1))
    for v in (0.05, 0.1, 0.5, 7):
        h.observe(v)
    assert list(h.lines("x")) == ['x_bucket{le="0.1"} 2', 'x_bucket{le="1"} 3', 'x_bucket{le="+Inf"} 4',
                                  "x_sum 7.65", "x_count 4"]
    m = Metrics('a"b')
    m.first_token(0.2)
    text = m.render()
    assert 'kie_time_to_first_token_seconds_count{model="a\\"b"} 1' in text and "kie_queue_length" in text


# -- the engine runner and the scheduler, with a stand-in model --------------------------
class CountingModel:
    """Logits that make token t follow token t-1 (mod 50): the tokens count up from the
    last prompt token; decode_step can be slowed down."""
    max_seq = 1000

    def __init__(self, step_s=0.0):
        self.step_s, self.steps = step_s, 0

    def reset(self):
        pass

    def _logits(self, t):
        z = np.zeros(260, np.float32)
        z[(t + 1) % 50 + 65] = 1  # letters and more: printable bytes of the byte-level tokenizer
        return z

    def prefill(self, ids, chunk=256):
        self.last = ids[-1]
        return self._logits(ids[-1] - 65)

    def decode_step(self, t):
        time.sleep(self.step_s)
        self.steps += 1
        return self._logits(t - 65)


def test_runner_stops_where_on_token_asks():
    r = EngineRunner(CountingModel(), 1000)
    res = r.run([65], 10, Sampling(), None, lambda t: t == 69)
    assert res.tokens == [66, 67, 68, 69] and res.reason == "stopped"
    res = r.run([65], 3, Sampling(), None, None)
    assert res.tokens == [66, 67, 68] and res.reason == "length"
    res = r.run([65], 10, Sampling(), {67}, None)
    assert res.tokens == [66, 67] and res.reason == "eos"
    with pytest.raises(ZeroDivisionError):
        r.run([65], 10, Sampling(), None, lambda t: 1 / 0)


def _drain(job):
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


def test_scheduler_fifo_429_cancel_and_shutdown():
    async def main():
        loop = asyncio.get_running_loop()
        model = CountingModel(step_s=0.01)
        metrics = Metrics("m")
        sch = Scheduler(EngineRunner(model, 1000), byte_level_tokenizer(), metrics, max_queue=2)
        sch.start()
        job = lambda n, stops=(): Job([65], n, Sampling(), None, stops, loop)  # noqa: E731
        long, a, b, c = job(400), job(3), job(5, ["DE"]), job(3)
        sch.submit(long)
        while sch.current is None:
            await asyncio.sleep(0.005)
        sch.submit(a)
        sch.submit(b)
        with pytest.raises(ApiError) as e:
            sch.submit(c)
        assert e.value.status == 429 and metrics.queue_length() == 2
        sch.cancel(long)  # running: stops at its next token
        ends = []
        for j in (a, b):
            while True:
                ev = await j.events.get()
                if ev[0] != "text":
                    ends.append((j, ev))
                    break
        assert [j for j, _ in ends] == [a, b]
        # b: B, C, D, E; the stop string "DE" ends it at E, and D is held back, then cut
        assert ends[0][1] == ("done", "length", 3) and ends[1][1] == ("done", "stop", 4)
        assert "".join(ev[1] for ev in _drain(b) if ev[0] == "text") == ""
        assert model.steps < 300  # the long job did not run to its end
        evs = _drain(long)
        assert evs[-1] == ("done", "cancelled", len(evs) - 1) and all(ev[0] == "text" for ev in evs[:-1])
        d, e2 = job(3), job(3)
        sch.submit(long := job(400))
        while sch.current is not long:
            await asyncio.sleep(0.005)
        sch.submit(d)
        sch.cancel(d)  # waiting: leaves the queue at once
        await asyncio.sleep(0.01)
        assert _drain(d) == [("done", "cancelled", 0)] and metrics.queue_length() == 0
        sch.submit(e2)
        sch.shutdown(0)
        with pytest.raises(ApiError) as e:
            sch.submit(job(1))
        assert e.value.status == 503
        assert await loop.run_in_executor(None, sch.join, 10)
        await asyncio.sleep(0.05)  # the engine thread's last posts reach the loop
        evs = _drain(long)
        assert evs[-1][0] == "error" and evs[-1][1].code == "server_shutdown" and evs[-1][1].status == 503
        assert [ev[0] for ev in _drain(e2)] == ["error"]
    asyncio.run(main())


def test_queue_limit_counts_requests_behind_the_running_one():
    async def main():
        loop = asyncio.get_running_loop()
        sch = Scheduler(EngineRunner(CountingModel(step_s=0.01), 1000), byte_level_tokenizer(), Metrics("m"),
                        max_queue=0)
        first = Job([65], 300, Sampling(), None, (), loop)
        sch.submit(first)  # an idle engine takes it, even with no room to wait
        sch.start()
        while sch.current is not first:
            await asyncio.sleep(0.005)
        with pytest.raises(ApiError) as e:
            sch.submit(Job([65], 1, Sampling(), None, (), loop))
        assert e.value.status == 429
        sch.shutdown(0)
        assert await loop.run_in_executor(None, sch.join, 10)
    asyncio.run(main())


# -- the HTTP stack's choices ------------------------------------------------------------
def test_http_stack_choices_need_their_modules(monkeypatch):
    """--http httptools / --loop uvloop without the module: a ValueError naming the flag
    (before the model loads); auto and the built-in choices need nothing."""
    import types
    from kie_engine.serve import server
    monkeypatch.setattr(server, "_installed", lambda name: False)
    for http, loop, flag in (("httptools", "auto", "--http httptools"), ("auto", "uvloop", "--loop uvloop")):
        with pytest.raises(ValueError, match=flag):
            server.check_http_stack(types.SimpleNamespace(http=http, loop=loop))
    server.check_http_stack(types.SimpleNamespace(http="h11", loop="asyncio"))
    server.check_http_stack(types.SimpleNamespace(http="auto", loop="auto"))
    assert server._loop_factory("auto") is None  # nothing installed: asyncio's own loop
    monkeypatch.setattr(server, "_installed", lambda name: True)
    assert server._loop_factory("asyncio") is None


def test_run_takes_the_loop_factory(monkeypatch):
    """serve's loop runner: asyncio's own loop without a factory, the factory's otherwise,
    with or without asyncio.Runner (Python 3.10 has none)."""
    from kie_engine.serve import server

    made = []

    def factory():
        loop = asyncio.new_event_loop()
        made.append(loop)
        return loop

    async def which():
        return asyncio.get_running_loop()

    assert server._run(which(), None) not in made
    assert server._run(which(), factory) is made[-1] and made[-1].is_closed()
    monkeypatch.delattr(asyncio, "Runner", raising=False)
    assert server._run(which(), factory) is made[-1] and made[-1].is_closed()
