"""SSEResponse: server-sent events written by a producer, which is cancelled (its requests aborted) when the client goes away."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

Emit = Callable[[bytes], Awaitable[None]]


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Emit], Awaitable[None]], headers: dict[str, str] | None = None) -> None:
        # no body: Response's own __init__ would announce Content-Length: 0
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})
        self.produce = produce  # public: a route that translates another's events (the Responses API) wraps it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def emit(chunk: bytes) -> None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        async with anyio.create_task_group() as tg:

            async def watch() -> None:  # the request body was read whole before: what comes now is the disconnect
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            await self.produce(emit)
            tg.cancel_scope.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[object]]) -> tuple[bool, object]:
    """Run work() unless the client goes away first (then it is cancelled: its requests are aborted, on record).
    Returns (finished, result)."""
    result: list[object] = []
    error: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result.append(await work())
        except Exception as exc:  # raised below as itself, not inside an ExceptionGroup
            error.append(exc)
        tg.cancel_scope.cancel()
    if error:
        raise error[0]
    return bool(result), result[0] if result else None
