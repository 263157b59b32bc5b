"""POST /v1/responses: OpenAI's Responses API, served through the chat route (responses_protocol.chat_request), its
chat completion (or chunks) turned into a response object (or the Responses API's streaming events: response.created,
output items, output_text and function_call_arguments deltas, response.completed). The response's id is the chat
request's: the audit key `loraledger audit show` takes."""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
from starlette.responses import Response

from loraledger.server.auth import Caller
from loraledger.server.responses_protocol import ResponsesRequest, chat_request
from loraledger.server.serving_engine import RequestContext, sse
from loraledger.server.streaming import SSEResponse


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }  # fmt: skip


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _function_call(call: dict[str, Any], status: str) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"], "status": status}  # fmt: skip


class _Shape:
    """The fields every response object of one request carries."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req

    def response(
        self, rid: str, created: int, status: str, output: list, usage=None, finish=None, receipts=None
    ) -> dict:
        req = self.req
        return {
            "id": rid, "object": "response", "created_at": created, "status": status, "model": req.model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "previous_response_id": None, "background": False, "metadata": req.metadata or {}, "user": req.user,
            "usage": _usage(usage), "receipts": receipts or [],  # the log's signed receipt (EVIDENCE.md)
        }  # fmt: skip


class OpenAIServingResponses:
    def __init__(self, chat) -> None:
        self.chat = chat

    async def create(self, req: ResponsesRequest, caller: Caller, ctx: RequestContext) -> Response:
        answer = await self.chat.create(chat_request(req), caller, ctx)
        if isinstance(answer, SSEResponse):
            return SSEResponse(lambda emit: answer.produce(_Events(req, emit).take))
        body = msgspec.json.decode(answer.body)
        choice = body["choices"][0]
        message = choice["message"]
        output = (
            [_message(f"msg_{secrets.token_hex(12)}", message["content"], "completed")] if message["content"] else []
        )
        output += [_function_call(call, "completed") for call in message["tool_calls"] or []]
        finish = choice["finish_reason"]
        status = "incomplete" if finish == "length" else "completed"
        shaped = _Shape(req).response(
            body["id"], body["created"], status, output, body["usage"], finish, body.get("receipts")
        )
        return Response(msgspec.json.encode(shaped), media_type="application/json")


class _Events(_Shape):
    """Chat completion chunks in, Responses API events out (one output item at a time, as OpenAI sends them)."""

    def __init__(self, req: ResponsesRequest, emit) -> None:
        super().__init__(req)
        self.emit = emit
        self.seq = 0
        self.rid, self.created = "", 0
        self.output: list[dict[str, Any]] = []  # the items done
        self.open: dict[str, Any] | None = None  # the item being written
        self.usage = self.finish = None
        self.receipts: list = []
        self.error: dict[str, Any] | None = None

    async def event(self, kind: str, **fields: Any) -> None:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        await self.emit(b"event: " + kind.encode() + b"\n" + sse(payload))

    async def take(self, data: bytes) -> None:
        text = data.removeprefix(b"data: ").strip()
        if text == b"[DONE]":
            return await self._done()
        chunk = msgspec.json.decode(text)
        if "error" in chunk:  # the request failed after it began: an error event, then response.failed
            self.error = {"code": chunk["error"].get("code"), "message": chunk["error"].get("message")}
            return await self.event("error", param=chunk["error"].get("param"), **self.error)
        if not self.rid:
            self.rid, self.created = chunk["id"], chunk["created"]
            start = self.response(self.rid, self.created, "in_progress", [])
            await self.event("response.created", response=start)
            await self.event("response.in_progress", response=start)
        self.receipts += chunk.get("receipts") or []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                await self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                await self._call(call)
            self.finish = choice.get("finish_reason") or self.finish

    async def _text(self, text: str) -> None:
        if self.open is None or self.open["type"] != "message":
            await self._close()
            self.open = _message(f"msg_{secrets.token_hex(12)}", "", "in_progress")
            self.open["content"] = []
            await self.event("response.output_item.added", output_index=len(self.output), item=self.open)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            await self.event("response.content_part.added", item_id=self.open["id"], output_index=len(self.output),
                             content_index=0, part=part)  # fmt: skip
            self.open["text"] = ""
        self.open["text"] += text
        await self.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output),
                         content_index=0, delta=text, logprobs=[])  # fmt: skip

    async def _call(self, delta: dict[str, Any]) -> None:
        fragment = delta.get("function", {}).get("arguments") or ""
        if "id" in delta:  # a new call: its name and id
            await self._close()
            self.open = _function_call({**delta, "function": {**delta["function"], "arguments": ""}}, "in_progress")
            await self.event("response.output_item.added", output_index=len(self.output), item=dict(self.open))
        if fragment and self.open is not None:
            self.open["arguments"] += fragment
            await self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                             output_index=len(self.output), delta=fragment)  # fmt: skip

    async def _close(self) -> None:
        item, index = self.open, len(self.output)
        if item is None:
            return
        self.open = None
        if item["type"] == "message":
            text = item.pop("text")
            done = _message(item["id"], text, "completed")
            part = done["content"][0]
            await self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=text, logprobs=[])  # fmt: skip
            await self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=part)  # fmt: skip
        else:
            done = {**item, "status": "completed"}
            await self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=item["arguments"])  # fmt: skip
        self.output.append(done)
        await self.event("response.output_item.done", output_index=index, item=done)

    async def _done(self) -> None:
        await self._close()
        status = "failed" if self.error else "incomplete" if self.finish == "length" else "completed"
        final = self.response(self.rid, self.created, status, self.output, self.usage, self.finish, self.receipts)
        final["error"] = self.error
        await self.event(f"response.{status}", response=final)
