"""tool_choice "auto" with --enable-auto-tool-choice --tool-call-parser hermes: the calls a model writes in the
Hermes/Qwen `<tool_call>` format come back as OpenAI tool_calls; text without a call stays content."""

from __future__ import annotations

import json

import openai
import pytest

from loraledger.errors import ConfigError
from loraledger.server.tools.parsers import parse_hermes, parse_llama3_json, parse_mistral
from tests.server.conftest import BASE, server_config
from tests.server.live import LiveServer

TOOLS = [
    {
        "type": "function",
        "function": {"name": "clock", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc"]}}}},
    }
]
CHAT = [{"role": "user", "content": "what time is it?"}]

# Qwen2.5-Instruct's own output for a call with a word before it, and two calls (its chat template's format)
QWEN_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
)
QWEN_TWO = (
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n'
    "</tool_call>"
)


def test_the_hermes_parser_reads_calls_and_leaves_other_text_as_content():
    content, calls = parse_hermes(QWEN_TEXT)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    content, calls = parse_hermes(QWEN_TWO)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{}, {"x": 1}]
    assert parse_hermes("no call here") == ("no call here", [])
    assert parse_hermes("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    _, calls = parse_hermes('<tool_call>{"name": "a", "arguments": {}}')  # cut before its closing tag
    assert calls[0]["function"]["name"] == "a"


def test_the_llama3_json_parser_reads_one_or_several_calls():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "clock", "parameters": {"zone": "utc"}}')
    assert content is None and calls[0]["function"]["name"] == "clock"
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "utc"}
    _, calls = parse_llama3_json('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert parse_llama3_json("The time is noon.") == ("The time is noon.", [])
    assert parse_llama3_json('{"city": "oslo"}') == ('{"city": "oslo"}', [])


def test_the_mistral_parser_reads_the_tool_calls_list():
    content, calls = parse_mistral('Sure. [TOOL_CALLS] [{"name": "clock", "arguments": {"zone": "utc"}}]')
    assert content == "Sure." and calls[0]["function"]["name"] == "clock"
    assert parse_mistral("[TOOL_CALLS] [oops") == ("[TOOL_CALLS] [oops", [])
    assert parse_mistral("plain") == ("plain", [])


def test_auto_tool_choice_needs_a_known_parser(tiny_llama_chat, tmp_path):
    with pytest.raises(ConfigError, match="tool-call-parser"):
        server_config(tiny_llama_chat, tmp_path, None, insecure_no_auth=True, enable_auto_tool_choice=True)


def test_auto_returns_the_call_the_model_wrote_and_plain_text_as_content(tiny_llama_chat, tmp_path):
    config = server_config(
        tiny_llama_chat, tmp_path, None, insecure_no_auth=True, enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    with LiveServer(config) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=60)
        wrote = '<tool_call>{"name": "clock", "arguments": {"zone": "utc"}}</tool_call>'
        r = client.chat.completions.create(
            model=BASE, messages=CHAT, tools=TOOLS, max_tokens=80, temperature=0,
            extra_body={"structured_outputs": {"regex": wrote.replace("{", r"\{").replace("}", r"\}")}},
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "clock" and json.loads(call.function.arguments) == {"zone": "utc"}
        plain = client.chat.completions.create(
            model=BASE, messages=CHAT, tools=TOOLS, tool_choice="auto", max_tokens=4, temperature=0
        )
        assert not plain.choices[0].message.tool_calls and plain.choices[0].message.content is not None
