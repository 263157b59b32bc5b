"""`tool_choice` "required" or a named function: the model's output is constrained (structured outputs, JSON schema)
so the call's arguments always parse against the function's schema, then returned as OpenAI `tool_calls`."""

from __future__ import annotations

import json
import secrets
from typing import Any

import msgspec

from loraledger.server.error_responses import APIError
from loraledger.structured_outputs import StructuredOutputsParams


class ForcedTools(msgspec.Struct, frozen=True):
    """What a request forces: one named function (`name`), or at least one call of any function (`name` None)."""

    constraint: StructuredOutputsParams
    name: str | None


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The tools' functions by name, each bad shape a 400 naming it."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        out[name] = params
    return out


def forced_tools(req) -> ForcedTools | None:
    """The constraint a request's tool_choice forces, or None ('none', 'auto' or no tools)."""
    choice = req.tool_choice
    if choice in (None, "none", "auto"):
        return None
    functions = _functions(req.tools)
    if not functions:
        raise APIError(400, "tool_choice needs tools: send the functions the model may call", param="tools")
    if getattr(req, "response_format", None) not in (None, {"type": "text"}) or req.structured_outputs is not None:
        raise APIError(400, "tool_choice and response_format both constrain the output; send one", param="tool_choice")
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
            for name, params in functions.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if getattr(req, "parallel_tool_calls", None) is False:
            schema["maxItems"] = 1  # one call, as OpenAI with parallel_tool_calls=false
        return ForcedTools(StructuredOutputsParams(json=schema), None)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in functions:
        raise APIError(
            400, f"tool_choice names {name!r}, which is not in tools {sorted(functions)}", param="tool_choice"
        )
    return ForcedTools(StructuredOutputsParams(json=functions[name]), name)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def tool_calls(forced: ForcedTools, text: str) -> list[dict[str, Any]] | None:
    """The constrained output as OpenAI tool_calls; None when the output is not whole JSON (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if forced.name is not None:
        return [_call(forced.name, value)]
    return [_call(call["name"], call["parameters"]) for call in value]
