"""Streamed tool calls: OpenAI's `delta.tool_calls` chunks from text that arrives a piece at a time.

One ToolStream per choice. `feed(text)` takes the next piece of output and returns what may be sent now: content,
and tool-call deltas (the first delta of a call carries its index, id, type and name; later ones argument
fragments). `finish()` returns what was held back. Auto streams hold back only text that may be the start of a call
marker (at most the marker's length) and release it as content once it cannot be; a call's body is kept until it
closes (bounded by max_tokens). Each piece costs time in its own length, never in the output's length so far.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from loraledger.server.tools.parsers import parse_llama3_json, parse_mistral

Delta = tuple[str, list[dict[str, Any]]]  # (content to send, tool-call deltas)


def _header(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ToolStream:
    """What every stream has: a count of the calls sent and the bound on them (parallel_tool_calls=false: one)."""

    def __init__(self, max_calls: int | None) -> None:
        self.calls = 0
        self.max_calls = max_calls

    def _call(self, name: str, arguments: Any) -> list[dict[str, Any]]:
        if self.max_calls is not None and self.calls >= self.max_calls:
            return []  # as vLLM and OpenAI with parallel_tool_calls=false: the first call is kept
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        self.calls += 1
        return [_header(self.calls - 1, name, text)]

    def feed(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self) -> Delta:
        return "", []


class NamedStream(ToolStream):
    """A named tool_choice: the output is the arguments (constrained to the function's schema), sent as they come."""

    def __init__(self, name: str) -> None:
        super().__init__(1)
        self.name = name

    def feed(self, text: str) -> Delta:
        if not text:
            return "", []
        if self.calls == 0:
            self.calls = 1
            return "", [_header(0, self.name, text)]
        return "", [{"index": 0, "function": {"arguments": text}}]


class RequiredStream(ToolStream):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects; each call is sent when
    its object closes (a scanner that reads each character once tracks strings and nesting)."""

    def __init__(self, max_calls: int | None) -> None:
        super().__init__(max_calls)
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.parts: list[str] = []  # the current call object's text

    def feed(self, text: str) -> Delta:
        calls: list[dict[str, Any]] = []
        start = 0 if self.depth >= 2 else None
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    start = i
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and start is not None:
                    self.parts.append(text[start : i + 1])
                    calls += self._close("".join(self.parts))
                    self.parts, start = [], None
        if start is not None:
            self.parts.append(text[start:])
        return "", calls

    def _close(self, body: str) -> list[dict[str, Any]]:
        try:
            value = json.loads(body)
        except ValueError:
            return []
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return []
        return self._call(value["name"], value.get("parameters", {}))


class MarkerStream(ToolStream):
    """Calls after a start marker: Hermes/Qwen `<tool_call>{...}</tool_call>` blocks (several), or Mistral's
    `[TOOL_CALLS] [...]` to the end of the output. Text before the first marker is content; text between or after
    blocks is not (as the unstreamed parser). A block whose body does not parse is sent as content when no call was
    sent before it."""

    def __init__(self, start: str, end: str | None, max_calls: int | None) -> None:
        super().__init__(max_calls)
        self.start, self.end = start, end
        self.held = ""  # outside a block: the tail that may begin the start marker (shorter than it)
        self.body: list[str] | None = None  # inside a block: its text so far
        self.tail = ""  # inside a block with an end marker: the body's last characters, to find the end in

    def feed(self, text: str) -> Delta:
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while text:
            if self.body is None:
                s = self.held + text
                at = s.find(self.start)
                if at < 0:
                    keep = next(
                        (k for k in range(min(len(self.start) - 1, len(s)), 0, -1) if self.start.startswith(s[-k:])), 0
                    )
                    self.held = s[len(s) - keep :]
                    self._content(content, s[: len(s) - keep])
                    return "".join(content), calls
                self._content(content, s[:at])
                self.held, self.body, self.tail = "", [], ""
                text = s[at + len(self.start) :]
                continue
            if self.end is None:
                self.body.append(text)
                break
            window = self.tail + text
            at = window.find(self.end)
            if at < 0:
                self.body.append(text)
                self.tail = window[-(len(self.end) - 1) :]
                break
            cut = at - len(self.tail)  # where the end marker starts in text (negative: it began in the tail)
            body = "".join(self.body)
            body = body[: len(body) + cut] if cut < 0 else body + text[:cut]
            calls += self._block(body, content, self.end)
            self.body = None
            text = text[cut + len(self.end) :]
        return "".join(content), calls

    def _content(self, content: list[str], text: str) -> None:
        if self.calls == 0 and text:  # after a call, text outside the blocks is dropped (whitespace, mostly)
            content.append(text)

    def _block(self, body: str, content: list[str], end: str) -> list[dict[str, Any]]:
        found = self._parse(body)
        if found is None:
            self._content(content, self.start + body + end)
            return []
        return [d for name, arguments in found for d in self._call(name, arguments)]

    def _parse(self, body: str) -> list[tuple[str, Any]] | None:
        if self.end is None:  # Mistral: the list after the marker
            _, calls = parse_mistral(self.start + body)
            return [(c["function"]["name"], c["function"]["arguments"]) for c in calls] or None
        try:
            value = json.loads(body.strip())
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        return [(value["name"], value.get("arguments", value.get("parameters", {})))]

    def finish(self) -> Delta:
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        if self.body is None:
            self._content(content, self.held)
        else:  # a block cut before its end marker: a call if its body parses, else content
            calls = self._block("".join(self.body), content, "")
        self.held, self.body = "", None
        return "".join(content), calls


class Llama3Stream(ToolStream):
    """Llama 3 JSON: the whole output is the call(s) when it begins with `{` or `<|python_tag|>`, else content. The
    start is held until it decides; an output that begins a call is kept whole and parsed at its end."""

    TAG = "<|python_tag|>"

    def __init__(self, max_calls: int | None) -> None:
        super().__init__(max_calls)
        self.mode = "undecided"  # then "content" or "call"
        self.parts: list[str] = []

    def feed(self, text: str) -> Delta:
        if self.mode == "content":
            return text, []
        self.parts.append(text)
        if self.mode == "call":
            return "", []
        head = "".join(self.parts)
        lead = head.lstrip()
        if not lead or (len(lead) < len(self.TAG) and self.TAG.startswith(lead)):
            return "", []
        if lead.startswith("{") or lead.startswith(self.TAG):
            self.mode = "call"
            return "", []
        self.mode, self.parts = "content", []
        return head, []

    def finish(self) -> Delta:
        text, self.parts = "".join(self.parts), []
        if self.mode != "call":
            return text, []
        content, calls = parse_llama3_json(text)
        if not calls:
            return text, []
        return "", [d for c in calls for d in self._call(c["function"]["name"], c["function"]["arguments"])]


def tool_stream(forced, parser: str | None, parallel: bool) -> ToolStream | None:
    """The stream for a choice: forced (a named function or "required"), auto with the server's parser, or None."""
    max_calls = None if parallel else 1
    if forced is not None:
        return NamedStream(forced.name) if forced.name is not None else RequiredStream(max_calls)
    if parser in ("hermes", "qwen", "qwen3"):
        return MarkerStream("<tool_call>", "</tool_call>", max_calls)
    if parser == "mistral":
        return MarkerStream("[TOOL_CALLS]", None, max_calls)
    if parser == "llama3_json":
        return Llama3Stream(max_calls)
    return None


def tool_delta(stream: ToolStream, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A chunk's delta for a choice's next text (and its end, when finish_reason is set), and its finish_reason:
    "tool_calls" once a call was sent, except for a named function ("stop", as OpenAI and the unstreamed answer)."""
    content, calls = stream.feed(text) if text else ("", [])
    if finish_reason is not None:
        more, last = stream.finish()
        content, calls = content + more, calls + last
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    if finish_reason is not None and stream.calls and not isinstance(stream, NamedStream):
        finish_reason = "tool_calls"
    return delta, finish_reason
