"""The evidence over HTTP: receipts in responses (the last chunk of a stream), the /evidence routes behind the keys,
and a witness and a receipt's verifier that read the log from the server."""

from __future__ import annotations

import json

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from loraledger.evidence import node_store, receipt
from loraledger.evidence.log_sources import HttpSource
from loraledger.evidence.proofs import InclusionProof, check_inclusion
from loraledger.evidence.receipt import Receipt
from loraledger.evidence.signed_note import parse_vkey
from loraledger.evidence.tlog_checkpoint import open_checkpoint
from loraledger.evidence.witness import Witness
from tests.server.conftest import BASE


def _get(live, path: str, key: str | None, **params) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{live.base_url}{path}", params=params, headers=headers, timeout=60)


def test_a_completion_carries_its_receipt_which_the_routes_prove(live, keys, tmp_path) -> None:
    r = httpx.post(f"{live.base_url}/v1/completions", headers={"Authorization": f"Bearer {keys.acme}"}, timeout=60,
                   json={"model": BASE, "prompt": "hello there", "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["receipts"]) == 1
    held = Receipt(**body["receipts"][0])
    vkey = _get(live, "/evidence/log-key", keys.acme).text.strip()
    fields = receipt.check_signature(held, parse_vkey(vkey))
    assert fields["audit_key"] == body["id"] and fields["tenant"] == "acme" and fields["key_id"] == keys.ids["acme"]
    assert receipt.matching_completion(fields, body["choices"][0]["text"]) == 0

    note = _get(live, "/evidence/checkpoint", keys.acme)
    assert note.status_code == 200 and note.headers["content-type"].startswith("text/plain")
    checkpoint, _ = open_checkpoint(note.text, parse_vkey(vkey))
    proof = _get(live, "/evidence/proof/inclusion", keys.acme, leaf=fields["leaf_index"], size=checkpoint.size)
    check_inclusion(node_store.leaf_of_event(fields["event_hash"]), InclusionProof(**proof.json()), checkpoint)

    # the receipt route: the caller's tenant (or an admin), behind a key
    assert _get(live, f"/evidence/receipt/{body['id']}", keys.acme).json() == body["receipts"][0]
    assert _get(live, f"/evidence/receipt/{body['id']}", keys.admin).status_code == 200
    assert _get(live, f"/evidence/receipt/{body['id']}", keys.globex).status_code == 404
    assert _get(live, f"/evidence/receipt/{body['id']}", None).status_code == 401
    assert _get(live, "/evidence/checkpoint", None).status_code == 401
    bad = _get(live, "/evidence/proof/inclusion", keys.acme, leaf=10**12)
    assert bad.status_code == 400 and "not in a tree" in bad.json()["error"]["message"]
    assert _get(live, "/evidence/proof/consistency", keys.acme, old=0).status_code == 400

    # a witness elsewhere reads the server; the log grows; it cosigns again after checking consistency
    witness = Witness("w.example/http", Ed25519PrivateKey.generate(), tmp_path / "w.json")
    source = HttpSource(live.base_url, keys.acme)
    witness.cosign(source.checkpoint(), parse_vkey(vkey), source.consistency)
    httpx.post(f"{live.base_url}/v1/completions", headers={"Authorization": f"Bearer {keys.acme}"}, timeout=60,
               json={"model": BASE, "prompt": "more", "max_tokens": 2})  # fmt: skip
    cosigned = witness.cosign(source.checkpoint(), parse_vkey(vkey), source.consistency)
    assert witness.last(checkpoint.origin).size > checkpoint.size and "w.example/http" in cosigned


def test_a_streamed_chat_puts_the_receipt_on_its_last_chunk(live, keys) -> None:
    chunks = []
    with httpx.stream("POST", f"{live.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {keys.acme}"},
                      timeout=60, json={"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                        "stream": True}) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    with_receipt = [i for i, c in enumerate(chunks) if "receipts" in c]
    assert with_receipt == [len(chunks) - 1], with_receipt
    last = chunks[-1]
    assert last["choices"] and last["choices"][0]["finish_reason"] is not None
    fields = receipt.check_signature(Receipt(**last["receipts"][0]))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert receipt.matching_completion(fields, text) == 0


def test_each_request_is_a_span_in_the_callers_trace_with_the_adapter_and_log_position(live, keys) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from loraledger.evidence.otel import RequestTracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    before = live.state.tracing
    live.state.tracing = RequestTracing(provider)
    try:
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        r = httpx.post(f"{live.base_url}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {keys.acme}", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
                       json={"model": "qv_r4", "prompt": "a traced request", "max_tokens": 3})  # fmt: skip
        assert r.status_code == 200, r.text
    finally:
        live.state.tracing = before
    (span,) = exporter.get_finished_spans()
    assert (
        format(span.context.trace_id, "032x") == trace_id and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    )
    a = span.attributes
    fields = json.loads(r.json()["receipts"][0]["body"])
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "qv_r4"
    assert a["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert tuple(a["gen_ai.response.finish_reasons"]) == (r.json()["choices"][0]["finish_reason"],)
    assert (
        a["loraledger.adapter.name"] == "qv_r4" and a["loraledger.adapter.fingerprint"] == fields["adapter_fingerprint"]
    )
    assert a["loraledger.audit_key"] == r.json()["id"] and a["loraledger.tenant"] == "acme"
    assert a["loraledger.log.seq"] == fields["seq"] and a["loraledger.log.leaf_index"] == fields["leaf_index"]
