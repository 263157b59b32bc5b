"""Structured outputs over HTTP: OpenAI's response_format (json_schema, json_object) through the openai client, vLLM's
structured_outputs and guided_* fields in extra_body, on record by kind and digest; bad constraints are 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from loraledger.sampling_params import StructuredOutputsParams
from loraledger.structured_outputs import canonical_constraint
from tests.server.audit_rows import binding
from tests.server.conftest import BASE

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "a user, as JSON"}]


def test_response_format_json_schema_through_the_openai_client(client, live):
    r = client.chat.completions.create(
        model="qv_r4", messages=CHAT, max_completion_tokens=160, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "stop", repr(choice.message.content)
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    row = binding(live.audit_url, r.id)
    assert (row.constraint_kind, row.constraint_sha256) == (
        "json",
        canonical_constraint(StructuredOutputsParams(json=SCHEMA)).sha256,
    )


def test_json_object_structured_outputs_and_guided_fields(client, live):
    obj = client.chat.completions.create(model=BASE, messages=CHAT, max_completion_tokens=24, temperature=0, seed=1,
                                         response_format={"type": "json_object"})  # fmt: skip
    # the random model may write a string up to the token limit: what it wrote is an object's start
    assert obj.choices[0].message.content.startswith("{")
    assert binding(live.audit_url, obj.id).constraint_kind == "json_object"
    choice = client.completions.create(model=BASE, prompt="pick one", max_tokens=8, temperature=0.8, seed=2,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})  # fmt: skip
    assert choice.choices[0].text in ("red", "green", "blue") and choice.choices[0].finish_reason == "stop"
    regex = client.completions.create(model="qv_r4", prompt="a code", max_tokens=12, temperature=0,
                                      extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"})  # fmt: skip
    assert len(regex.choices[0].text) == 7 and regex.choices[0].text[3] == "-"


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"structured_outputs": {"regex": "(a"}}, "does not compile"),
        ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "exactly one kind"),
        ({"structured_outputs": {"jsn": {}}}, "unknown fields"),
        ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "more than one way"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(live, keys, extra, says):
    r = httpx.post(f"{live.base_url}/v1/completions", headers={"Authorization": f"Bearer {keys.acme}"},
                   json={"model": BASE, "prompt": "hi", "max_tokens": 4, **extra})  # fmt: skip
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert httpx.post(f"{live.base_url}/v1/completions", headers={"Authorization": f"Bearer {keys.acme}"},
                      json={"model": BASE, "prompt": "hi", "max_tokens": 2}).status_code == 200  # fmt: skip


def test_the_openai_client_error_type(client):
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        client.completions.create(
            model=BASE, prompt="x", max_tokens=2, extra_body={"guided_grammar": "root ::= nowhere"}
        )
