"""HTTP exchanges as messages: a request a router hands to a replica, and the replica's response as a stream of
messages, made by running the server's own ASGI app (so a replica serves exactly the routes of `loraledger serve`).

Ray Serve carries these between its deployments (a handle call's argument, a streaming call's items); nothing
here imports Ray. It runs on asyncio, as uvicorn and Ray Serve do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
import msgspec
import structlog
from starlette.types import ASGIApp, Message

from loraledger.server.error_responses import error_response

# a response's body chunks in flight between the app and the relay (bounded: a slow reader slows the app)
BODY_BUFFER = 64


class HttpRequest(msgspec.Struct, frozen=True, tag=True):
    """An HTTP request whose body has been read whole (the router read it to find the `model` it names)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    root_path: str = ""


class HttpResponseStart(msgspec.Struct, frozen=True, tag=True):
    status: int
    headers: tuple[tuple[bytes, bytes], ...] = ()


class HttpBody(msgspec.Struct, frozen=True, tag=True):
    """A piece of the body; the last one has more=False (SSE: one per event, as the app sends them)."""

    data: bytes
    more: bool = False


async def run_asgi(app: ASGIApp, request: HttpRequest) -> AsyncIterator[HttpResponseStart | HttpBody]:
    """Serve `request` with `app` and yield its response as it is sent. Closing the iterator early (the caller
    went away) is a client disconnect: the app sees `http.disconnect` and its task is cancelled, so a generation
    route aborts its requests (on record as aborted) exactly as under uvicorn."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode("latin-1"),
        "query_string": request.query_string,
        "root_path": request.root_path,
        "headers": [(k.lower(), v) for k, v in request.headers],
        "client": request.client,
        "server": None,
    }
    sent, received = anyio.create_memory_object_stream[HttpResponseStart | HttpBody](BODY_BUFFER)
    body_given = False
    gone = anyio.Event()

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    started = False

    async def send(message: Message) -> None:
        nonlocal started
        if message["type"] == "http.response.start":
            started = True
            await sent.send(
                HttpResponseStart(
                    status=message["status"], headers=tuple((k, v) for k, v in message.get("headers", ()))
                )
            )
        elif message["type"] == "http.response.body":
            await sent.send(HttpBody(data=bytes(message.get("body", b"")), more=bool(message.get("more_body", False))))

    async def serve() -> None:
        async with sent:
            try:
                await app(scope, receive, send)
            except Exception as exc:  # what uvicorn does: log it; a response not yet begun becomes a 500
                structlog.get_logger().bind(actor="server").error(
                    "the app failed on a relayed request", error=f"{type(exc).__name__}: {exc}", route=request.path
                )
                if not started:
                    await error_response(500, "the server failed on this request", type="server_error")(
                        scope, receive, send
                    )

    # an asyncio task, not a task group: a task group's cancel scope cannot span the yields of an async generator
    # that its consumer may close, or leave to the garbage collector, from another task
    task = asyncio.ensure_future(serve())
    finished = False
    try:
        async with received:
            async for message in received:
                yield message
        finished = True  # the app returned: its post-response work (metrics, the in-flight count) is done
    finally:
        if not finished:  # closed early: the caller went away
            gone.set()
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, return_exceptions=True)
