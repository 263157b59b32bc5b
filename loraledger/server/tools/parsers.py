"""Tool-call parsers for `tool_choice: "auto"`: the calls a model wrote in its own format, chosen by name with
`--tool-call-parser` as vLLM does; what does not parse as a call stays content."""

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


PARSERS = {"hermes": parse_hermes, "qwen": parse_hermes, "qwen3": parse_hermes}
