"""Server-Sent Events and the ASGI response that streams them while watching the client:
when the client disconnects, on_gone() runs at once (the job is cancelled at its next
token), not only when a later write fails (a write may be long in coming while a stop
string holds text back, or never come)."""
import asyncio
import json

DONE = b"data: [DONE]\n\n"


def dumps(obj):
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def event(obj):
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"


async def until_disconnect(receive):
    """Returns when the client has gone (the request body was read before)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class EventStream:
    """An ASGI response: `chunks` (an async iterator of bytes) as text/event-stream."""

    def __init__(self, chunks, on_gone):
        self.chunks, self.on_gone = chunks, on_gone

    async def _stream(self, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send):
        streaming = asyncio.ensure_future(self._stream(send))
        watching = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streaming, watching):
                t.cancel()
            self.on_gone()  # a no-op once the job has ended
            await asyncio.gather(streaming, watching, return_exceptions=True)
