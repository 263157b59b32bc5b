"""run_asgi: a relayed request served by an ASGI app, its response as messages (what a Ray replica sends back)."""

from __future__ import annotations

import anyio
import msgspec
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, StreamingResponse

from loraledger.server.asgi_relay import HttpBody, HttpRequest, HttpResponseStart, run_asgi


def make_app(seen: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.json()
        return JSONResponse(
            {"got": body, "auth": request.headers.get("authorization"), "q": request.url.query},
            headers={"x-served": "yes"},
        )

    @app.get("/stream")
    async def stream():
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await anyio.sleep(0.01)
            except BaseException:
                seen["cancelled"] = True
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def collect(app, request: HttpRequest, limit: int | None = None) -> list:
    out = []
    stream = run_asgi(app, request)
    async for message in stream:
        out.append(message)
        if limit is not None and len(out) >= limit:
            break
    await stream.aclose()
    return out


async def test_a_request_is_served_whole_with_its_headers_and_body():
    request = HttpRequest(method="POST", path="/echo", query_string=b"a=1", headers=((b"Authorization", b"Bearer k"), (b"content-type", b"application/json")),
                          body=b'{"model": "sql"}')  # fmt: skip
    start, *bodies = await collect(make_app({}), request)
    assert isinstance(start, HttpResponseStart) and start.status == 200 and (b"x-served", b"yes") in start.headers
    assert all(isinstance(b, HttpBody) for b in bodies) and not bodies[-1].more
    assert msgspec.json.decode(b"".join(b.data for b in bodies)) == {
        "got": {"model": "sql"},
        "auth": "Bearer k",
        "q": "a=1",
    }


async def test_a_stream_is_relayed_as_it_is_sent_and_a_caller_who_leaves_cancels_it():
    seen: dict = {}
    start, *events = await collect(make_app(seen), HttpRequest(method="GET", path="/stream"), limit=4)
    assert start.status == 200 and [e.data for e in events] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert seen.get("cancelled"), "the app's response was not stopped when the caller went away"


async def test_an_app_failure_before_its_response_is_a_500_error_object():
    async def broken(scope, receive, send):
        raise RuntimeError("broken")

    start, *bodies = await collect(broken, HttpRequest(method="GET", path="/boom"))
    assert start.status == 500
    assert msgspec.json.decode(b"".join(b.data for b in bodies))["error"]["type"] == "server_error"


def test_the_messages_cross_a_process_boundary_unchanged():
    import pickle

    for message in (
        HttpRequest(method="GET", path="/x", body=b"\x00"),
        HttpResponseStart(status=201, headers=((b"a", b"b"),)),
        HttpBody(data=b"z", more=True),
    ):
        assert pickle.loads(pickle.dumps(message)) == message
