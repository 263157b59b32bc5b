"""Tool calls on record: what a request's tools were (the binding's tools_sha256, and tools_text per audit_prompts)
and the calls each completion made (the completion's tool_calls, canonical JSON), read from its text the way the
server reads them: a forced call's constrained JSON, or the auto parser's reading of what the model wrote.

The HTTP server makes a ToolCallSpec for a request with tools; the engine reads each finished completion's calls
with `recorded_calls`, a pure function of the spec and the text, so an auditor can recompute them from the row.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from loraledger.digests import canonical_json
from loraledger.tool_parsers import PARSERS

MODES = ("named", "required", "auto", "none")


class ToolCallSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A request's tools and how its output is read as calls. mode: "named" (the output is the arguments of
    `name`), "required" (a JSON array of {"name", "parameters"}), "auto" (the calls `parser` finds in the text) or
    "none" (tools given to the template, no call read); parallel=False keeps the first call."""

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None
    parser: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"ToolCallSpec.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "auto" and self.parser not in PARSERS:
            raise ValueError(f"ToolCallSpec.parser must be one of {sorted(PARSERS)} for auto, got {self.parser!r}")
        if self.mode == "named" and not isinstance(self.name, str):
            raise ValueError("ToolCallSpec.name must name the function for mode 'named'")

    def canonical_tools(self) -> str:
        """The tool definitions as canonical JSON text (the binding's tools_text; tools_sha256 is its sha256)."""
        return canonical_json(self.tools).decode()


def _function_name(tool: Any) -> Any:
    function = tool.get("function") if isinstance(tool, dict) else None
    return function.get("name") if isinstance(function, dict) else None


def reading_of(spec: ToolCallSpec) -> dict[str, Any]:
    """How a request's calls are read, as its binding's `tool_reading` records it: mode, parser, parallel, and the
    named function by its index in the tools (`name_index`; its name is caller content, kept with the tools)."""
    index = None
    if spec.mode == "named":
        index = next((i for i, t in enumerate(spec.tools) if _function_name(t) == spec.name), None)
    return {"mode": spec.mode, "parser": spec.parser, "parallel": spec.parallel, "name_index": index}


def spec_from_record(tools: list[dict[str, Any]], reading: dict[str, Any]) -> ToolCallSpec:
    """The ToolCallSpec a binding's tools and `tool_reading` describe (a resumed request reads its calls by it);
    ValueError when they do not make one (a named function whose index is not among the tools)."""
    name = None
    if reading.get("mode") == "named":
        index = reading.get("name_index")
        if (
            not isinstance(index, int)
            or not 0 <= index < len(tools)
            or not isinstance(_function_name(tools[index]), str)
        ):
            raise ValueError(f"tool_reading names function index {index!r}, which is not among the {len(tools)} tools")
        name = _function_name(tools[index])
    return ToolCallSpec(
        tools=tools,
        mode=reading.get("mode"),
        name=name,
        parser=reading.get("parser"),
        parallel=bool(reading.get("parallel", True)),
    )


def _argument_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def calls_of(spec: ToolCallSpec, text: str) -> list[dict[str, Any]]:
    """The calls in a completion's text, each {"name", "arguments"} with the arguments as JSON values; [] for none."""
    if spec.mode == "none":
        return []
    if spec.mode in ("named", "required"):
        try:
            value = json.loads(text)
        except ValueError:
            return []  # cut by max_tokens before the JSON closed: content, no call
        if spec.mode == "named":
            calls = [{"name": spec.name, "arguments": value}]
        elif isinstance(value, list):
            calls = [
                {"name": c["name"], "arguments": c.get("parameters", {})}
                for c in value
                if isinstance(c, dict) and isinstance(c.get("name"), str)
            ]
        else:
            calls = []
    else:
        _, parsed = PARSERS[spec.parser](text)
        calls = [
            {"name": c["function"]["name"], "arguments": _argument_value(c["function"]["arguments"])} for c in parsed
        ]
    return calls[:1] if not spec.parallel else calls


def recorded_calls(spec: ToolCallSpec | None, text: str) -> str | None:
    """A completion's tool_calls column: the canonical JSON of its calls, or None without tools or without a call."""
    if spec is None:
        return None
    calls = calls_of(spec, text)
    if not calls:
        return None
    try:
        return canonical_json(calls).decode()
    except (TypeError, ValueError):  # arguments with no canonical form (NaN): kept as the model wrote them
        return canonical_json([{**c, "arguments": json.dumps(c["arguments"])} for c in calls]).decode()


def kept_calls(spec: ToolCallSpec | None, request_id: str, texts: list[tuple[int, str]]) -> dict[int, tuple[Any, str]]:
    """The calls of each completion (index, text) that made any, as kept apart: index -> (its `tool_calls` text row
    under a fresh salt, the commitment its completions row carries). The arguments are the model's output, caller
    content that `audit erase` must be able to remove."""
    from loraledger.store.records import TOOL_CALLS, salted_content

    out = {}
    for index, text in texts:
        calls = recorded_calls(spec, text)
        if calls is not None:
            out[index] = salted_content(request_id, TOOL_CALLS, index, calls)
    return out
