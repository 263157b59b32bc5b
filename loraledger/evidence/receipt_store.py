"""Issuing receipts in the writer's transaction: one per request_finished event it appends, kept in `receipts`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Table, insert, select

from loraledger.digests import canonical_json
from loraledger.evidence import receipt
from loraledger.evidence.log_key import LogKey
from loraledger.evidence.receipt import Receipt
from loraledger.store.models import Completion, Event, Request
from loraledger.store.models import Receipt as ReceiptRow
from loraledger.store.records import EventKind

RECEIPTS: Table = ReceiptRow.__table__  # type: ignore[assignment]
_REQUESTS: Table = Request.__table__  # type: ignore[assignment]
_COMPLETIONS: Table = Completion.__table__  # type: ignore[assignment]
_EVENTS: Table = Event.__table__  # type: ignore[assignment]


def issue_after(conn: Connection, key: LogKey, after_seq: int, request_ids: Sequence[str]) -> dict[str, Receipt]:
    """Sign and keep a receipt for each request of request_ids whose request_finished event is past after_seq
    (written in this transaction); returns them by audit key."""
    if not request_ids:
        return {}
    ids = sorted(set(request_ids))
    finished = conn.execute(
        select(_EVENTS.c.seq, _EVENTS.c.hash, _EVENTS.c.request_id, _EVENTS.c.payload, _EVENTS.c.at).where(
            _EVENTS.c.kind == EventKind.REQUEST_FINISHED, _EVENTS.c.seq > after_seq, _EVENTS.c.request_id.in_(ids)
        )
    ).all()
    if not finished:
        return {}
    ended = [row.request_id for row in finished]
    bindings = {
        row["request_id"]: dict(row)
        for row in conn.execute(select(_REQUESTS).where(_REQUESTS.c.request_id.in_(ended))).mappings()
    }
    completions: dict[str, list[dict[str, Any]]] = {}
    for row in conn.execute(select(_COMPLETIONS).where(_COMPLETIONS.c.request_id.in_(ended))).mappings():
        completions.setdefault(row["request_id"], []).append(dict(row))
    issued: dict[str, Receipt] = {}
    rows = []
    for event in finished:
        binding = bindings.get(event.request_id)
        if binding is None:
            continue  # a request with no binding row gets no receipt (verify reports the missing row)
        body = receipt.body_of(
            binding,
            completions.get(event.request_id, []),
            origin=key.origin,
            seq=event.seq,
            event_hash=event.hash,
            finished=event.payload if isinstance(event.payload, dict) else {},
            issued_at=canonical_json(event.at).decode().strip('"'),
        )
        signed = receipt.issue(key, body)
        issued[event.request_id] = signed
        rows.append({"request_id": event.request_id, "seq": event.seq, "body": signed.body, "signature": signed.signature,
                     "log_key": signed.log_key})  # fmt: skip
    if rows:
        conn.execute(insert(RECEIPTS), rows)
    return issued


def stored(conn: Connection, audit_key: str) -> Receipt | None:
    row = conn.execute(select(RECEIPTS).where(RECEIPTS.c.request_id == audit_key)).first()
    if row is None:
        return None
    return Receipt(body=row.body, signature=row.signature, log_key=row.log_key)
