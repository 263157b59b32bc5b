"""Issuing receipts in the writer's transaction: one per request_finished event it appends, kept in `receipts`."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Table, insert, select

from loraledger.digests import canonical_json
from loraledger.evidence import receipt
from loraledger.evidence.log_key import LogKey
from loraledger.evidence.receipt import Receipt
from loraledger.store import texts
from loraledger.store.models import Completion, Request
from loraledger.store.models import Receipt as ReceiptRow
from loraledger.store.records import COMPLETION, AuditBatch, EventKind

RECEIPTS: Table = ReceiptRow.__table__  # type: ignore[assignment]
_REQUESTS: Table = Request.__table__  # type: ignore[assignment]
_COMPLETIONS: Table = Completion.__table__  # type: ignore[assignment]


_BINDING_COLUMNS = ("request_id", "caller_request_id", "tenant", "key_id", "lora_name", "adapter_fingerprint",
                    "base_model_fingerprint", "constraint_kind", "constraint_sha256", "prompt_sha256", "prompt_token_count")  # fmt: skip


def _bindings(conn: Connection, batch: AuditBatch, ids: list[str]) -> dict[str, dict[str, Any]]:
    """The binding fields a receipt names: from the batch where it admits the request, else from `requests`."""
    found = {r.request_id: {c: getattr(r, c) for c in _BINDING_COLUMNS} for r in batch.requests if r.request_id in ids}
    missing = [rid for rid in ids if rid not in found]
    if missing:
        columns = [_REQUESTS.c[c] for c in _BINDING_COLUMNS if c in _REQUESTS.c]
        for row in conn.execute(select(*columns).where(_REQUESTS.c.request_id.in_(missing))).mappings():
            found[row["request_id"]] = dict(row)
    return found


def _completions(conn: Connection, batch: AuditBatch, ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each request's completions: from the batch that finishes it (where the engine puts them), else from the table."""
    found: dict[str, list[dict[str, Any]]] = {}
    kept = {(t.request_id, t.index): t for t in batch.texts if t.part == COMPLETION}
    for c in batch.completions:
        if c.request_id in ids:
            text = kept.get((c.request_id, c.index))  # salted text (revision 0013): the row holds commitments
            found.setdefault(c.request_id, []).append(
                {"completion_index": c.index, "text": c.text if text is None else text.text,
                 "token_ids": c.token_ids if text is None else text.token_ids,
                 "finish_reason": c.finish_reason, "generated_token_count": c.generated_token_count}
            )  # fmt: skip
    missing = [rid for rid in ids if rid not in found]
    if missing:
        stored = texts.stored(conn, missing)
        for row in conn.execute(select(_COMPLETIONS).where(_COMPLETIONS.c.request_id.in_(missing))).mappings():
            row = dict(row)
            text = stored.get((row["request_id"], COMPLETION, row["completion_index"]))
            if text is not None:
                row["text"], row["token_ids"] = text.text, list(text.token_ids)
            found.setdefault(row["request_id"], []).append(row)
    return found


def issue(conn: Connection, key: LogKey, batch: AuditBatch, appended: list[dict[str, Any]]) -> dict[str, Receipt]:
    """Sign and keep a receipt for each request_finished event among appended (the event rows this transaction
    just chained for batch); returns them by audit key."""
    finished = [e for e in appended if e["kind"] == EventKind.REQUEST_FINISHED and e["request_id"] is not None]
    if not finished:
        return {}
    ids = [e["request_id"] for e in finished]
    bindings, completions = _bindings(conn, batch, ids), _completions(conn, batch, ids)
    issued: dict[str, Receipt] = {}
    rows = []
    for event in finished:
        rid = event["request_id"]
        binding = bindings.get(rid)
        if binding is None:
            continue  # a request with no binding row gets no receipt (verify reports the missing row)
        body = receipt.body_of(
            binding, completions.get(rid, []), origin=key.origin, seq=event["seq"], event_hash=event["hash"],
            finished=event["payload"] if isinstance(event["payload"], dict) else {},
            issued_at=canonical_json(event["at"]).decode().strip('"'),
        )  # fmt: skip
        signed = receipt.issue(key, body)
        issued[rid] = signed
        rows.append({"request_id": rid, "seq": event["seq"], "body": signed.body, "signature": signed.signature,
                     "log_key": signed.log_key})  # fmt: skip
    if rows:
        conn.execute(insert(RECEIPTS), rows)
    return issued


def stored(conn: Connection, audit_key: str) -> Receipt | None:
    row = conn.execute(select(RECEIPTS).where(RECEIPTS.c.request_id == audit_key)).first()
    if row is None:
        return None
    return Receipt(body=row.body, signature=row.signature, log_key=row.log_key)
