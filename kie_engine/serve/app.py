"""The HTTP side (Starlette): routes, OpenAI response shapes, errors.  Every handler turns
a refusal into an OpenAI-shaped error and any unexpected exception into a 500 of the same
shape without a traceback; nothing a request does can stop the server."""
import asyncio
import os
import secrets
import sys
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..formats.chat import ChatTemplateError
from ..generate import Sampling
from .api_error import ApiError
from .scheduler import Job
from .schemas import check_context, parse_chat, parse_completion, parse_json
from .sse import DONE, EventStream, dumps, event, until_disconnect

MAX_BODY = 8 << 20
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")


@dataclass
class ServeState:
    """What the handlers need: the served model's name and context, its tokenizer, chat
    template and stop ids, the scheduler and the metrics."""
    model_id: str
    context: int
    vocab_size: int
    tokenizer: object
    template: object          # a ChatTemplate, or None (then /v1/chat/completions answers 400)
    eos_ids: frozenset        # end of text
    chat_stop_ids: frozenset  # end of text and the template's end of turn
    scheduler: object
    metrics: object
    lanes: int = 1
    created: int = 0


class _Json(JSONResponse):
    def render(self, content):
        return dumps(content).encode("utf-8")


def error_response(e: ApiError):
    return _Json(e.body(), status_code=e.status)


def _sampling(req):
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    return Sampling(req.temperature, req.top_k, req.top_p, seed)


def build_app(st: ServeState):
    page = open(os.path.join(STATIC, "chat.html"), "rb").read()

    def answered(endpoint, status):
        st.metrics.request(endpoint, status)

    async def read_body(request):
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY:  # refused before it is read
            raise ApiError(413, f"the request body has {declared} bytes; the limit is {MAX_BODY}",
                           code="request_too_large")
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"the request body has {len(raw)} bytes; the limit is {MAX_BODY}",
                           code="request_too_large")
        return parse_json(raw)

    def prompt_of(req, chat):
        tk = st.tokenizer
        if chat:
            if st.template is None:
                raise ApiError(400, f"the model '{st.model_id}' has no chat template: use /v1/completions",
                               code="no_chat_template")
            try:
                text = st.template.render(req.messages)
            except ChatTemplateError as e:  # e.g. a template that wants user and assistant to alternate
                raise ApiError(400, f"the model's chat template refused these messages: {e}", param="messages")
            return tk.encode(text, add_special_tokens=False).ids, st.chat_stop_ids
        ids = req.prompt if isinstance(req.prompt, list) else tk.encode(req.prompt).ids
        return ids, st.eos_ids

    async def generate_endpoint(request, chat):
        endpoint = request.url.path
        try:
            body = await read_body(request)
            req = parse_chat(body, st.model_id) if chat else parse_completion(body, st.model_id, st.vocab_size)
            # off the event loop: a chat template renders in its renderer process (kie_engine/formats/bounded.py)
            ids, stop_ids = await asyncio.to_thread(prompt_of, req, chat)
            if any(i >= st.vocab_size for i in ids):
                raise ApiError(400, f"the tokenizer produced an id outside the model's vocabulary of {st.vocab_size}")
            max_tokens = check_context(len(ids), req.max_tokens, st.context)
            job = Job(ids, max_tokens, _sampling(req), None if req.ignore_eos else set(stop_ids), req.stop,
                      asyncio.get_running_loop())
            st.scheduler.submit(job)
        except ApiError as e:
            answered(endpoint, e.status)
            return error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = _Shape(rid, st.model_id, chat, len(ids))
        if req.stream:
            answered(endpoint, 200)
            return EventStream(_sse(job, shape, req.include_usage), lambda: st.scheduler.cancel(job))
        return await _collect(request, job, shape, endpoint)

    async def _collect(request, job, shape, endpoint):
        parts = []

        async def read_all():
            while True:
                ev = await job.events.get()
                if ev[0] == "text":
                    parts.append(ev[1])
                else:
                    return ev

        reading = asyncio.ensure_future(read_all())
        watching = asyncio.ensure_future(until_disconnect(request.receive))
        gone = False
        try:
            await asyncio.wait({reading, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not reading.done():  # the client is gone
                gone = True
                reading.cancel()
                st.scheduler.cancel(job)
        if gone:
            answered(endpoint, 499)  # nginx's "client closed request": nobody reads this answer
            return Response(status_code=499)
        ev = reading.result()
        if ev[0] == "error":
            answered(endpoint, ev[1].status)
            return error_response(ev[1])
        answered(endpoint, 200)
        return _Json(shape.whole("".join(parts), ev[1], ev[2]))

    async def chat_completions(request):
        return await generate_endpoint(request, True)

    async def completions(request):
        return await generate_endpoint(request, False)

    def model_card():
        return {"id": st.model_id, "object": "model", "created": st.created, "owned_by": "kie",
                "max_model_len": st.context}

    async def models(request):
        answered("/v1/models", 200)
        return _Json({"object": "list", "data": [model_card()]})

    async def model(request):
        name = request.path_params["name"]
        if name != st.model_id:
            answered("/v1/models/{name}", 404)
            return error_response(ApiError(404, f"the model '{name}' does not exist; this server serves "
                                                f"'{st.model_id}'", param="model", code="model_not_found"))
        answered("/v1/models/{name}", 200)
        return _Json(model_card())

    async def health(request):
        sch = st.scheduler
        ok = not sch.closing and sch.fatal is None
        answered("/health", 200 if ok else 503)
        return _Json({"status": "ok" if ok else ("shutting down" if sch.fatal is None else "engine failed"),
                      "model": st.model_id, "lanes": st.lanes, "queue_length": len(sch.waiting),
                      "running": sch.running()}, status_code=200 if ok else 503)

    async def metrics(request):
        answered("/metrics", 200)
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def index(request):
        answered("/", 200)
        return HTMLResponse(page)

    async def http_error(request, exc):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = {404: f"no route {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        answered("other", exc.status_code)
        return error_response(ApiError(exc.status_code, msg, code=code))

    async def server_error(request, exc):
        print(f"kie serve: {request.method} {request.url.path} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        answered(request.url.path, 500)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error",
                                       code="internal_error"))

    def guarded(handler):
        """The handler, with a client that left mid-request answered by nothing (499 in the
        metrics) and any unexpected exception by an OpenAI-shaped 500 and one line on stderr
        (Starlette's own handler would let uvicorn print the traceback too)."""
        async def run(request):
            try:
                return await handler(request)
            except ClientDisconnect:
                answered(request.url.path, 499)
                return Response(status_code=499)
            except Exception as e:
                return await server_error(request, e)
        return run

    routes = [Route("/", guarded(index)), Route("/health", guarded(health)), Route("/metrics", guarded(metrics)),
              Route("/v1/models", guarded(models)), Route("/v1/models/{name:path}", guarded(model)),
              Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
              Route("/v1/completions", guarded(completions), methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


class _Shape:
    """The OpenAI objects of one request: chat.completion(.chunk) or text_completion."""

    def __init__(self, rid, model_id, chat, prompt_tokens):
        self.rid, self.model, self.chat, self.prompt_tokens = rid, model_id, chat, prompt_tokens
        self.created = int(time.time())

    def _head(self, obj):
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def usage(self, n):
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def whole(self, text, reason, n):
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage(n)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage(n)}

    def usage_chunk(self, n):
        """stream_options.include_usage: the last chunk, with no choices."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage(n)}

    def chunk(self, text=None, reason=None, role=False):
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        return out


async def _sse(job, shape, include_usage):
    u = {} if not include_usage else {"usage": None}  # with include_usage every chunk carries "usage": null
    if shape.chat:
        yield event({**shape.chunk(role=True), **u})
    while True:
        ev = await job.events.get()
        if ev[0] == "text":
            yield event({**shape.chunk(ev[1]), **u})
        elif ev[0] == "error":
            yield event(ev[1].body())
            yield DONE
            return
        else:
            _, reason, n = ev
            yield event({**shape.chunk(reason=reason), **u})
            if include_usage:
                yield event(shape.usage_chunk(n))
            yield DONE
            return
