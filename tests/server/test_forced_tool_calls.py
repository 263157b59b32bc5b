"""tool_choice "required" and a named function through the openai client: the output is constrained to the
functions' JSON schemas, so every call's arguments parse and validate, whatever the (random) model writes."""

from __future__ import annotations

import json

import httpx
import jsonschema

from tests.server.conftest import BASE

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "description": "the time", "parameters": TIME}},
]
CHAT = [{"role": "user", "content": "weather in oslo?"}]


def test_a_named_tool_choice_returns_a_call_whose_arguments_validate(client):
    for model in (BASE, "qv_r4"):
        r = client.chat.completions.create(
            model=model, messages=CHAT, tools=TOOLS, max_completion_tokens=160, temperature=0,
            tool_choice={"type": "function", "function": {"name": "clock"}},
        )  # fmt: skip
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop" and message.content is None
        (call,) = message.tool_calls
        assert call.type == "function" and call.function.name == "clock" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_required_returns_calls_of_the_given_functions_each_valid(client):
    r = client.chat.completions.create(
        model="qv_r4", messages=CHAT, tools=TOOLS, tool_choice="required", max_completion_tokens=200, temperature=0.8,
        seed=3,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", repr(choice.message)
    assert len(choice.message.tool_calls) >= 1
    schemas = {"weather": WEATHER, "clock": TIME}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_bad_tool_choices_are_400_naming_the_fix(live, keys):
    bad = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "not in tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice must be"),
        ({"tool_choice": "required", "tools": [{"type": "function"}]}, "tools[0]"),
    ]
    for extra, words in bad:
        body = {"model": BASE, "messages": CHAT, "max_tokens": 4, **extra}
        r = httpx.post(
            f"{live.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {keys.acme}"},
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 400, (extra, r.text)
        assert words in r.json()["error"]["message"], r.text
