"""Tool-call parsers for `tool_choice: "auto"`: the calls a model wrote in its own format, chosen by name with
`--tool-call-parser` as vLLM does; what does not parse as a call stays content. Pure functions of the text: the
server answers with them and the engine puts their result on record (loraledger.tool_calls)."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": text}}


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional content.
    Returns (content, calls); with no block that parses, (text, [])."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text, start):
        try:
            value = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return text, []
        calls.append(_call(value["name"], value.get("arguments", value.get("parameters", {}))))
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _calls_of(value: Any) -> list[dict[str, Any]] | None:
    """Calls from decoded JSON: one {"name", "arguments" | "parameters"} object or a list of them; else None."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(_call(item["name"], item.get("arguments", item.get("parameters", {}))))
    return calls or None


def parse_llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3.x JSON: the whole output is `{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`),
    several joined by `; `. Anything else is content."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        found = _calls_of(value)
        if found is None:
            return text, []
        calls.extend(found)
        at = end
        while at < len(body) and body[at] in "; \n":
            at += 1
    return None, calls


def parse_mistral(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Mistral: content, then `[TOOL_CALLS]` and a JSON list of {"name", "arguments"} objects."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start + len("[TOOL_CALLS]") :].lstrip())
    except ValueError:
        return text, []
    calls = _calls_of(value)
    if calls is None:
        return text, []
    return text[:start].strip() or None, calls


PARSERS = {
    "hermes": parse_hermes,
    "qwen": parse_hermes,
    "qwen3": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}
