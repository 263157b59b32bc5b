"""The Responses API through the openai client's `client.responses.create`, stream and not, on a real server: text
and message-list input, instructions, max_output_tokens, forced function calls with function_call /
function_call_output items in the input, the documented streaming events, usage, key rights as on chat, and clear
400s for what is not served (stored responses, built-in tools)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import BASE
from tests.server.test_forced_tool_calls import TIME, WEATHER

FLAT_TOOLS = [
    {"type": "function", "name": "weather", "description": "the weather", "parameters": WEATHER},
    {"type": "function", "name": "clock", "description": "the time", "parameters": TIME},
]


def events(stream) -> list:
    return list(stream)


def test_text_input_answers_as_the_same_chat_does(client):
    r = client.responses.create(
        model="qv_r4", input="tell me of the sea", instructions="be brief", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model="qv_r4", max_completion_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me of the sea"}],
    )  # fmt: skip
    assert r.object == "response" and r.model == "qv_r4"
    assert r.output_text == chat.choices[0].message.content
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    finish = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_streamed_text_sends_the_documented_events_in_order(client):
    args = dict(model=BASE, input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
                max_output_tokens=10, temperature=0)  # fmt: skip
    whole = client.responses.create(**args)
    got = events(client.responses.create(**args, stream=True))
    kinds = [e.type for e in got]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in got] == list(range(len(got)))
    text = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    assert text == whole.output_text == got[-4].text
    final = got[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == got[0].response.id


def test_a_named_function_after_call_and_output_items_returns_a_valid_function_call(client):
    conversation = [
        {"role": "user", "content": "what time is it?"},
        {"type": "function_call", "call_id": "call_1", "name": "clock", "arguments": '{"zone": "utc"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "noon"},
        {"role": "user", "content": "and the weather?"},
    ]
    args = dict(model="qv_r4", input=conversation, tools=FLAT_TOOLS, tool_choice={"type": "function", "name": "weather"},
                max_output_tokens=160, temperature=0)  # fmt: skip
    r = client.responses.create(**args)
    (item,) = r.output
    assert item.type == "function_call" and item.name == "weather" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    got = events(client.responses.create(**args, stream=True))
    kinds = [e.type for e in got]
    assert kinds[2] == "response.output_item.added" and got[2].item.type == "function_call"
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    fragments = "".join(e.delta for e in got if e.type == "response.function_call_arguments.delta")
    assert fragments == got[-3].arguments == got[-1].response.output[0].arguments
    assert json.loads(fragments) == json.loads(item.arguments)


def test_required_with_parallel_false_streams_one_call(client):
    got = events(client.responses.create(
        model=BASE, input="time?", tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=240, temperature=0.8, stream=True, extra_body={"seed": 5},
    ))  # fmt: skip
    final = got[-1].response
    assert got[-1].type == "response.completed" and len(final.output) == 1
    call = final.output[0]
    jsonschema.validate(json.loads(call.arguments), {"weather": WEATHER, "clock": TIME}[call.name])


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "built-in tools are not served"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text parts"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "served items are"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice must be"),
    ],
)
def test_what_is_not_served_is_a_400_naming_what_is(live, keys, extra, words):
    body = {"model": BASE, "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(
        f"{live.base_url}/v1/responses", json=body, headers={"Authorization": f"Bearer {keys.acme}"}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.text


def test_key_rights_are_the_chat_routes(live, keys):
    with openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=keys.globex, max_retries=0, timeout=60) as globex:
        with pytest.raises(openai.APIStatusError) as chat:
            globex.chat.completions.create(model="qv_r4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.APIStatusError) as responses:
            globex.responses.create(model="qv_r4", input="hi", max_output_tokens=2)
        assert responses.value.status_code == chat.value.status_code in (403, 404)
        assert globex.responses.create(model="all_r8", input="hi", max_output_tokens=2).status in (
            "completed",
            "incomplete",
        )
    r = httpx.post(f"{live.base_url}/v1/responses", json={"model": BASE, "input": "hi"}, timeout=60)
    assert r.status_code == 401
