"""Receipts: the log's signed statement, handed to a caller with its output, of what it was served and where it is logged.

A receipt is JSON: `format`, `body` (a canonical JSON text, kept as text so its bytes are the ones
signed), `signature` (base64 Ed25519 over `loraledger-receipt/v1\\n` followed by the body's UTF-8
bytes) and `log_key` (the log's verifier key, a C2SP vkey). The body binds the audit key, the
caller's id, tenant and key id, the adapter and base model, the constraint, the digest of the prompt
and of each completion's text and token ids, and the request_finished event's place in the log (its
seq, leaf index seq - 1, and chain hash, whose RFC 9162 leaf hash an inclusion proof leads from).

The digests (defined in loraledger/digests.py with every other; EVIDENCE.md states their bytes): `text_sha256` is the
SHA-256 of the completion text's UTF-8 bytes; `token_ids_sha256` the SHA-256 of the canonical JSON
list of its token ids; `prompt_sha256` is the binding's own.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import TYPE_CHECKING, Any

import msgspec
from cryptography.exceptions import InvalidSignature

from loraledger import digests
from loraledger.digests import canonical_json
from loraledger.errors import EvidenceError
from loraledger.evidence import signed_note
from loraledger.evidence.signed_note import Verifier

if TYPE_CHECKING:
    from loraledger.evidence.log_key import LogKey

FORMAT = "loraledger-receipt/v1"
MAX_RECEIPT_BYTES = 1 << 20


class Receipt(msgspec.Struct, frozen=True, kw_only=True):
    format: str = FORMAT
    body: str
    signature: str
    log_key: str

    def fields(self) -> dict[str, Any]:
        return json.loads(self.body)


text_sha256 = digests.text_sha256  # SHA-256 of the text's UTF-8 bytes
token_ids_sha256 = digests.token_ids_sha256  # SHA-256 of the canonical JSON list of the token ids


def message(body: str) -> bytes:
    return f"{FORMAT}\n".encode() + body.encode("utf-8")


def body_of(
    binding: dict[str, Any],
    completions: list[dict[str, Any]],
    *,
    origin: str,
    seq: int,
    event_hash: str,
    finished: dict[str, Any],
    issued_at: str,
) -> dict[str, Any]:
    """The receipt body of one finished request: binding (a `requests` row), its completions rows, and its
    request_finished event (seq, hash, payload)."""
    return {
        "log": origin,
        "audit_key": binding["request_id"],
        "caller_request_id": binding.get("caller_request_id"),
        "tenant": binding.get("tenant"),
        "key_id": binding.get("key_id"),
        "lora_name": binding.get("lora_name"),
        "adapter_fingerprint": binding.get("adapter_fingerprint"),
        "adapter_revision": binding.get("adapter_revision"),
        "base_model_fingerprint": binding.get("base_model_fingerprint"),
        "quantization": binding.get("quantization"),
        "constraint_kind": binding.get("constraint_kind"),
        "constraint_sha256": binding.get("constraint_sha256"),
        "prompt_sha256": binding.get("prompt_sha256"),
        "prompt_token_count": binding.get("prompt_token_count"),
        "completions": [
            {
                "index": c["completion_index"],
                "text_sha256": text_sha256(c["text"]),
                "token_ids_sha256": token_ids_sha256(c["token_ids"]),
                "finish_reason": c["finish_reason"],
                "generated_token_count": c["generated_token_count"],
            }
            for c in sorted(completions, key=lambda c: c["completion_index"])
        ],
        "completions_sha256": finished.get("completions_sha256"),
        "seq": seq,
        "leaf_index": seq - 1,
        "event_hash": event_hash,
        "issued_at": issued_at,
    }


def issue(key: LogKey, body: dict[str, Any]) -> Receipt:
    text = canonical_json(body).decode("utf-8")
    return Receipt(body=text, signature=base64.b64encode(key.sign(message(text))).decode(), log_key=key.verifier.vkey())


def load(data: bytes | str) -> Receipt:
    if len(data) > MAX_RECEIPT_BYTES:
        raise EvidenceError(f"a receipt over {MAX_RECEIPT_BYTES} bytes is refused")
    try:
        receipt = msgspec.json.decode(data, type=Receipt)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise EvidenceError(f"not a receipt ({{format, body, signature, log_key}}): {exc}") from None
    if receipt.format != FORMAT:
        raise EvidenceError(f"receipt format {receipt.format!r} is not {FORMAT!r}")
    return receipt


def dumps(receipt: Receipt) -> bytes:
    return msgspec.json.format(msgspec.json.encode(receipt), indent=2) + b"\n"


def check_signature(receipt: Receipt, trusted: Verifier | None = None) -> dict[str, Any]:
    """The receipt's body once its signature verifies under its log key (which must be trusted's, when given)."""
    key = signed_note.parse_vkey(receipt.log_key)
    if trusted is not None and (key.name, key.public) != (trusted.name, trusted.public):
        raise EvidenceError(f"the receipt is signed by {receipt.log_key}, not by the trusted log key {trusted.vkey()}")
    try:
        signature = base64.b64decode(receipt.signature, validate=True)
        key.public_key().verify(signature, message(receipt.body))
    except (binascii.Error, InvalidSignature, ValueError):
        raise EvidenceError(
            "the receipt's signature does not verify: the receipt was altered or not signed by its log key"
        ) from None
    try:
        body = json.loads(receipt.body)
    except json.JSONDecodeError:
        raise EvidenceError("the receipt's body is not JSON") from None
    if not isinstance(body, dict) or body.get("log") != key.name:
        raise EvidenceError("the receipt's body does not name the log whose key signed it")
    return body


def matching_completion(body: dict[str, Any], text: str) -> int | None:
    """The index of the completion whose text is text, or None."""
    digest = text_sha256(text)
    return next((c["index"] for c in body.get("completions", []) if c.get("text_sha256") == digest), None)
