"""Batch 1 with a FIFO queue.  Requests wait in arrival order; one engine thread takes
them one at a time and runs each to its end (end of text, max_tokens, a stop string, its
client gone, or shutdown).  The engine thread also turns tokens into text, so a stop
string ends the generation at the very token that completes it; text and the final
outcome reach the request's handler through an asyncio queue on the event loop."""
import asyncio
import sys
import threading
import time
from collections import deque

from .api_error import ApiError
from .text import TextStream


class Job:
    """One request's generation.  Its handler reads .events: ("text", str), then
    ("done", finish_reason, completion_tokens) or ("error", ApiError)."""

    def __init__(self, prompt_ids, max_tokens, sampling, stop_ids, stops, loop):
        self.prompt_ids, self.max_tokens, self.sampling = list(prompt_ids), max_tokens, sampling
        self.stop_ids, self.stops = stop_ids, list(stops)
        self.loop = loop
        self.events = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.cancelled = False   # set on the event loop, read by the engine thread at each token
        self.ended = False       # its last event was posted

    def post(self, *event):
        if event[0] in ("done", "error"):
            self.ended = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class EngineQueue:
    """What both schedulers share: the FIFO of waiting requests with its limit, cancellation
    and shutdown on the event loop's side, and the engine thread that runs the subclass's
    _work.  A subclass says how many requests the engine could take now (_room) and how
    many it runs (running)."""

    def __init__(self, metrics, max_queue, on_fatal):
        self.metrics, self.max_queue = metrics, max_queue
        self.on_fatal = on_fatal          # called (from the engine thread) when the engine is unusable
        self.cv = threading.Condition()
        self.waiting = deque()
        self.closing = False
        self.deadline = None              # at shutdown: running requests are cut at this time
        self.fatal = None
        self.thread = threading.Thread(target=self._work, name="kie-engine", daemon=True)
        metrics.queue_length = lambda: len(self.waiting)
        metrics.running = self.running

    def start(self):
        self.thread.start()

    def join(self, timeout=None):
        self.thread.join(timeout)
        return not self.thread.is_alive()

    # -- the event loop's side -------------------------------------------------------------
    def submit(self, job):
        with self.cv:
            if self.closing:
                raise ApiError(503, "the server is shutting down", type="server_error", code="server_shutdown")
            # max_queue counts the requests behind running ones: room in the engine takes more
            if len(self.waiting) >= self.max_queue + self._room():
                raise ApiError(429, f"the queue is full ({len(self.waiting)} requests wait for the engine; the "
                                    f"limit is {self.max_queue}): retry later", type="rate_limit_error",
                               code="queue_full")
            self.waiting.append(job)
            self.cv.notify()

    def cancel(self, job):
        """The client is gone: a waiting job leaves the queue; a running one is dropped by
        the engine thread before its next token."""
        with self.cv:
            job.cancelled = True
            if job in self.waiting:
                self.waiting.remove(job)
                self.metrics.finish("cancelled", 0, 0)
                job.post("done", "cancelled", 0)

    def shutdown(self, grace_s):
        """No new requests; the waiting ones get 503; running ones may finish within grace_s
        seconds, else they are cut."""
        with self.cv:
            if self.closing:
                return
            self.closing = True
            self.deadline = time.perf_counter() + grace_s
            for job in self.waiting:
                self.metrics.finish("shutdown", 0, 0)
                job.post("error", ApiError(503, "the server is shutting down", type="server_error",
                                           code="server_shutdown"))
            self.waiting.clear()
            self.cv.notify_all()

    # -- the engine thread's side ----------------------------------------------------------
    def _engine_failed(self, e):
        """After a request (or a batch step) failed with e: if e left the lanes out of step,
        no later request can run, so the queue closes and on_fatal hears of it."""
        if not _breaks_engine(e):
            return
        self.fatal = e
        with self.cv:
            self.closing = True
        if self.on_fatal is not None:
            self.on_fatal(e)


class Scheduler(EngineQueue):
    def __init__(self, runner, tokenizer, metrics, max_queue=32, on_fatal=None):
        self.runner, self.tokenizer = runner, tokenizer
        self.current = None
        super().__init__(metrics, max_queue, on_fatal)

    def running(self):
        return int(self.current is not None)

    def _room(self):
        return int(self.current is None)

    # -- the engine thread -----------------------------------------------------------------
    def _work(self):
        try:
            while True:
                with self.cv:
                    while not self.waiting and not self.closing:
                        self.cv.wait()
                    if not self.waiting:
                        return
                    job = self.current = self.waiting.popleft()
                try:
                    self._run(job)
                finally:
                    self.current = None
                if self.fatal is not None:
                    return
        finally:
            link = self.runner.link
            if link is not None and self.fatal is None:
                link.finish()  # every lane leaves its loop

    def _run(self, job):
        text = TextStream(self.tokenizer, job.stops)
        metrics, last = self.metrics, [None]

        def on_token(t):
            now = time.perf_counter()
            if last[0] is None:
                metrics.first_token(now - job.arrived)
            else:
                metrics.next_token(now - last[0])
            last[0] = now
            piece = text.push(t)
            if piece:
                job.post("text", piece)
            if text.hit:
                return True
            return job.cancelled or (self.deadline is not None and now >= self.deadline)

        try:
            res = self.runner.run(job.prompt_ids, job.max_tokens, job.sampling, job.stop_ids, on_token)
            if res.reason != "stopped":
                rest = text.finish()
                if rest:
                    job.post("text", rest)
        except Exception as e:  # the request fails, the server goes on (unless the lanes broke)
            metrics.finish("error", len(job.prompt_ids), 0)
            job.post("error", ApiError(500, f"the engine failed on this request: {type(e).__name__}: {e}",
                                       type="server_error", code="engine_error"))
            print(f"kie serve: a request failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            self._engine_failed(e)
            return
        n = len(res.tokens)
        if text.hit or res.reason == "eos":
            reason = "stop"
        elif res.reason == "length":
            reason = "length"
        elif job.cancelled:
            reason = "cancelled"
        else:
            reason = "shutdown"
        metrics.finish(reason, len(job.prompt_ids), n)
        if reason == "shutdown":
            job.post("error", ApiError(503, f"the server is shutting down: the generation was cut after {n} tokens",
                                       type="server_error", code="server_shutdown"))
        else:
            job.post("done", reason, n)


def _breaks_engine(e):
    """A communicator error leaves the lanes out of step: no later request can run."""
    try:
        from kccl import KcclError
    except ImportError:
        return False
    return isinstance(e, KcclError)
