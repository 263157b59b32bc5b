"""The streamed tool-call parsers, piece by piece: whatever way the output is cut into pieces, the content and the
calls they send add up to what the unstreamed parser reads from the whole text; text that only looked like the start
of a marker comes back as content; parallel_tool_calls=false keeps the first call."""

from __future__ import annotations

import json
import random
import time

import pytest

from loraledger.server.tools.call_stream import tool_stream
from loraledger.server.tools.forced import ForcedTools
from loraledger.server.tools.parsers import PARSERS
from loraledger.structured_outputs import StructuredOutputsParams

TEXTS = {
    "hermes": [
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>',
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n'
        "</tool_call>",
        "no call here, though < and <tool are near the end <tool_ca",
        '<tool_call>{"name": "a", "arguments": {"s": "</tool"}}',  # cut before its closing tag
        "a < b and <tool_call>{not json</tool_call> after",
    ],
    "mistral": [
        'Sure. [TOOL_CALLS] [{"name": "clock", "arguments": {"zone": "utc"}}, {"name": "b", "arguments": {}}]',
        "[TOOL_CALLS] [oops",
        "plain [TOOL_ and more",
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "clock", "parameters": {"zone": "utc"}}',
        '  {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
        "The time is noon.",
        "<|python but not a tag",
        '{"city": "oslo"}',
    ],
}


def pieces(text: str, rng: random.Random) -> list[str]:
    out, at = [], 0
    while at < len(text):
        step = rng.choice([1, 1, 2, 3, 5, 8])
        out.append(text[at : at + step])
        at += step
    return out


def run(stream, parts: list[str]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    content, deltas = [], []
    for part in [*parts, None]:
        text, calls = stream.feed(part) if part is not None else stream.finish()
        content.append(text)
        deltas += calls
    calls: dict[int, list] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function" and d["id"].startswith("call_")
            calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
        else:
            calls[d["index"]][1] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))  # indexes 0, 1, ... in order
    return "".join(content), [tuple(calls[i]) for i in sorted(calls)], deltas


@pytest.mark.parametrize("parser", sorted(TEXTS))
def test_streamed_auto_calls_add_up_to_the_unstreamed_parse_however_the_text_is_cut(parser):
    rng = random.Random(0)
    for text in TEXTS[parser]:
        want_content, want_calls = PARSERS[parser](text)
        want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want_calls]
        for cut in [[text], list(text), *(pieces(text, rng) for _ in range(20))]:
            content, calls, _ = run(tool_stream(None, parser, True), cut)
            assert [(name, json.loads(args)) for name, args in calls] == want, (text, cut)
            if want:
                assert content.strip() == (want_content or ""), (text, cut)
            else:
                assert content == text, (text, cut)  # nothing held back for good


def test_parallel_tool_calls_false_keeps_the_first_call():
    for parser, text in (
        ("hermes", TEXTS["hermes"][1]),
        ("mistral", TEXTS["mistral"][0]),
        ("llama3_json", TEXTS["llama3_json"][1]),
    ):
        _, calls, _ = run(tool_stream(None, parser, False), list(text))
        assert [name for name, _ in calls] == ["a" if parser != "mistral" else "clock"]


def test_forced_streams_send_the_name_first_then_argument_fragments():
    named = ForcedTools(StructuredOutputsParams(json={"type": "object"}), "clock")
    _, calls, deltas = run(tool_stream(named, None, True), ['{"zo', 'ne": ', '"utc"}'])
    assert calls == [("clock", '{"zone": "utc"}')]
    assert [d["function"] for d in deltas[1:]] == [{"arguments": 'ne": '}, {"arguments": '"utc"}'}]
    required = ForcedTools(StructuredOutputsParams(json={"type": "array"}), None)
    text = '[{"name": "a", "parameters": {"s": "}]\\"{"}}, {"parameters": {"x": [1, {"y": 2}]}, "name": "b"}]'
    for cut in ([text], list(text)):
        _, calls, _ = run(tool_stream(required, None, True), cut)
        assert [(n, json.loads(a)) for n, a in calls] == [("a", {"s": '}]"{'}), ("b", {"x": [1, {"y": 2}]})]


def test_each_piece_costs_the_same_however_long_the_output_so_far():
    def per_piece(history: int) -> float:
        stream = tool_stream(None, "hermes", True)
        stream.feed('<tool_call>{"name": "a", "arguments": {"s": "' + "x" * history)
        t = time.perf_counter()
        for _ in range(2000):
            stream.feed("xy<")
        return time.perf_counter() - t

    short, long = min(per_piece(10) for _ in range(3)), min(per_piece(2_000_000) for _ in range(3))
    assert long < 3 * short + 0.01, (short, long)
