"""The Responses API's request (POST /v1/responses) and its translation into a chat completion request: input items
become chat messages, function tools chat tools, so a response is rendered, constrained, parsed, authorised and put
on record exactly as the same conversation on /v1/chat/completions.

What is not served is refused with a 400 naming what is: stored responses (`store: true`,
`previous_response_id`, `conversation`, `background`), built-in tools (web search, file search, ...), non-text
input parts and prompt templates.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraledger.server.error_responses import APIError
from loraledger.server.protocol import ChatCompletionRequest

SERVED = "served here: text or message-list input, instructions, function tools, streaming, store=false"


class ResponsesRequest(BaseModel):
    """POST /v1/responses: OpenAI's fields; those without effect here (metadata, billing and cache hints) ignored."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    text: dict[str, Any] | None = None
    user: str | None = Field(default=None, max_length=1024)
    seed: int | None = None  # vLLM's extra
    # refused unless absent or off: what needs responses kept by the server
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    truncation: str | None = None
    # accepted without effect (as on the chat route)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None


def _refuse_unserved(req: ResponsesRequest) -> None:
    refused = [
        ("store", req.store, "responses are not stored here; send store=false (or leave it out)"),
        ("previous_response_id", req.previous_response_id, "responses are not stored here; send the whole conversation as input"),
        ("conversation", req.conversation, "conversations are not stored here; send the whole conversation as input"),
        ("background", req.background, "background responses need storage; send background=false"),
        ("include", req.include, "no extra output data is served; leave include out"),
        ("prompt", req.prompt, "prompt templates are not served; send input and instructions"),
        ("max_tool_calls", req.max_tool_calls, "max_tool_calls is not served; use parallel_tool_calls=false for one call"),
    ]  # fmt: skip
    for param, value, why in refused:
        if value:
            raise APIError(400, f"{param}: {why} ({SERVED})", param=param)
    if req.truncation not in (None, "disabled"):
        raise APIError(400, "truncation: only 'disabled' is served (a long input is refused)", param="truncation")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(
                400, f"{where}.content[{j}] is {kind!r}: only text parts (input_text, output_text) are served",
                param="input",
            )  # fmt: skip
        texts.append(part["text"])
    return "".join(texts)


def messages_of(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of instructions and input: messages, function_call items (an assistant message's
    tool_calls; consecutive calls share one) and function_call_output items (tool messages)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", param="input")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(x, str) for x in (call_id, name, arguments)):
                raise APIError(
                    400, f"{where}: a function_call needs call_id, name and arguments strings", param="input"
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str | list):
                raise APIError(400, f"{where}: a function_call_output needs call_id and output", param="input")
            text = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise APIError(
                400, f"{where} is a {kind!r} item: served items are message, function_call and function_call_output",
                param="input",
            )  # fmt: skip
    if not messages:
        raise APIError(400, "input is empty: send text or at least one message", param="input")
    return messages


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(req.tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(
                400, f"tools[{i}] is {kind!r}: built-in tools are not served, only function tools ({SERVED})",
                param="tools",
            )  # fmt: skip
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", param="tool_choice"
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if fmt == {"type": "json_object"}:
        return fmt
    raise APIError(400, "text.format must be text, json_schema or json_object", param="text")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves a Responses request (one choice; usage in the stream)."""
    _refuse_unserved(req)
    body = {
        "model": req.model, "messages": messages_of(req), "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": _tools(req), "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "stream": bool(req.stream), "user": req.user, "seed": req.seed,
        "response_format": _response_format(req.text), "n": 1,
    }  # fmt: skip
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest(**{k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}", param="input") from None
