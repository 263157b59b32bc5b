"""Streamed tool calls through the openai client: forced calls (a named function, "required") and auto calls
(hermes) arrive as OpenAI's delta.tool_calls chunks that add up to calls whose arguments validate;
parallel_tool_calls=false gives one call."""

from __future__ import annotations

import json

import jsonschema
import openai

from tests.server.conftest import BASE, server_config
from tests.server.live import LiveServer
from tests.server.test_forced_tool_calls import CHAT, TIME, TOOLS, WEATHER


def collect(stream) -> tuple[str, dict[int, dict], str | None]:
    """The content, the calls by index ({id, name, arguments}) and the finish_reason of choice 0."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for d in delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), calls, finish


def test_a_named_tool_choice_streams_the_name_then_arguments_that_validate(client):
    stream = client.chat.completions.create(
        model="qv_r4", messages=CHAT, tools=TOOLS, max_completion_tokens=160, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "clock"}},
    )  # fmt: skip
    content, calls, finish = collect(stream)
    assert content == "" and finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "clock" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)
    unstreamed = client.chat.completions.create(
        model="qv_r4", messages=CHAT, tools=TOOLS, max_completion_tokens=160, temperature=0,
        tool_choice={"type": "function", "function": {"name": "clock"}},
    )  # fmt: skip
    assert json.loads(unstreamed.choices[0].message.tool_calls[0].function.arguments) == json.loads(
        calls[0]["arguments"]
    )


def test_required_streams_each_call_and_parallel_false_makes_it_one(client):
    schemas = {"weather": WEATHER, "clock": TIME}
    for parallel, seed in ((True, 3), (False, 3), (False, 5)):
        stream = client.chat.completions.create(
            model=BASE, messages=CHAT, tools=TOOLS, tool_choice="required", max_completion_tokens=240,
            temperature=0.8, seed=seed, stream=True, parallel_tool_calls=parallel,
        )  # fmt: skip
        content, calls, finish = collect(stream)
        assert finish == "tool_calls" and content == "", (content, calls)
        assert sorted(calls) == list(range(len(calls))) and (parallel or len(calls) == 1)
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_auto_streams_the_call_the_model_wrote_and_plain_text_as_content(tiny_llama_chat, tmp_path):
    config = server_config(
        tiny_llama_chat, tmp_path, None, insecure_no_auth=True, enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    wrote = (
        'I check, <tool_call>{"name": "clock", "arguments": {"zone": "utc"}}</tool_call>'
        '<tool_call>{"name": "weather", "arguments": {"city": "oslo", "unit": "c"}}</tool_call>'
    )
    regex = {"regex": wrote.replace("{", r"\{").replace("}", r"\}")}
    with LiveServer(config) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=60)
        for parallel in (True, False):
            stream = client.chat.completions.create(
                model=BASE, messages=CHAT, tools=TOOLS, max_tokens=400, temperature=0, stream=True,
                parallel_tool_calls=parallel, extra_body={"structured_outputs": regex},
            )  # fmt: skip
            content, calls, finish = collect(stream)
            assert content == "I check, " and finish == "tool_calls"
            got = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
            want = [("clock", {"zone": "utc"}), ("weather", {"city": "oslo", "unit": "c"})]
            assert got == (want if parallel else want[:1])
            r = client.chat.completions.create(
                model=BASE, messages=CHAT, tools=TOOLS, max_tokens=400, temperature=0, parallel_tool_calls=parallel,
                extra_body={"structured_outputs": regex},
            )  # fmt: skip
            unstreamed = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
            assert unstreamed == got
        plain = client.chat.completions.create(
            model=BASE, messages=CHAT, tools=TOOLS, max_tokens=8, temperature=0, stream=True
        )
        content, calls, finish = collect(plain)
        unstreamed = client.chat.completions.create(model=BASE, messages=CHAT, tools=TOOLS, max_tokens=8, temperature=0)
        assert calls == {} and content == unstreamed.choices[0].message.content
