"""OpenAI's legacy function calling (`functions`, `function_call`, `role: "function"` messages) as the tools it
stands for: the request is served as `tools` / `tool_choice`, and the answer also carries the legacy
`message.function_call` that clients of that API read."""

from __future__ import annotations

from typing import Any


class LegacyFunctionsError(ValueError):
    """A body mixing the two forms, or a legacy field of the wrong shape (a 400 naming the field)."""


def as_tools(functions: Any, function_call: Any, tools: Any, tool_choice: Any) -> tuple[list | None, Any]:
    """The (tools, tool_choice) a body's legacy fields stand for; the new fields pass through when no legacy one is
    given. `function_call`: "none", "auto" or {"name": ...}, as `tool_choice`'s "none", "auto" or named function."""
    if functions is None and function_call is None:
        return tools, tool_choice
    if tools is not None or tool_choice is not None:
        raise LegacyFunctionsError("send tools/tool_choice or the legacy functions/function_call, not both")
    if functions is None:
        raise LegacyFunctionsError("function_call needs functions: send the functions the model may call")
    if not isinstance(functions, list) or not all(isinstance(f, dict) for f in functions):
        raise LegacyFunctionsError("functions must be a list of {name, description, parameters} objects")
    converted = [{"type": "function", "function": dict(f)} for f in functions]
    if function_call is None or function_call in ("none", "auto"):
        return converted, function_call
    name = function_call.get("name") if isinstance(function_call, dict) else None
    if not isinstance(name, str) or not name:
        raise LegacyFunctionsError('function_call must be "none", "auto" or {"name": ...}')
    return converted, {"type": "function", "function": {"name": name}}


def as_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation's legacy turns in the tools form chat templates render: an assistant's `function_call` as one
    `tool_calls` entry, a `role: "function"` result as a `role: "tool"` message (its `name` kept)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        call = message.get("function_call")
        if message.get("role") == "assistant" and isinstance(call, dict) and "tool_calls" not in message:
            message = {k: v for k, v in message.items() if k != "function_call"}
            message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": dict(call)}]
        elif message.get("role") == "function":
            message = {**message, "role": "tool"}
        out.append(message)
    return out


def legacy_answer(choice: dict[str, Any]) -> None:
    """A chat choice as a legacy client reads it: the first tool call as `message.function_call`, finish_reason
    "function_call" (the tool_calls stay, for clients that read those)."""
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    if calls:
        message["function_call"] = dict(calls[0]["function"])
        if choice.get("finish_reason") in ("tool_calls", "stop"):
            choice["finish_reason"] = "function_call"
