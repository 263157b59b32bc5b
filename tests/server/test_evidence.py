"""The evidence over HTTP: receipts in responses (the last chunk of a stream), the /evidence routes behind the keys,
and a witness and a receipt's verifier that read the log from the server."""

from __future__ import annotations

import json

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from loraledger.evidence import node_store, receipt
from loraledger.evidence.checkpoint import open_checkpoint
from loraledger.evidence.proofs import InclusionProof, check_inclusion
from loraledger.evidence.receipt import Receipt
from loraledger.evidence.signed_note import parse_vkey
from loraledger.evidence.sources import HttpSource
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
