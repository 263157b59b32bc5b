"""What `verify` checks of the evidence tables: the Merkle tree against the events, and every signed checkpoint
and receipt against the tree and the chain.

The tree is checked level by level, each level a merge of two ordered streams: level 0 against
the events' hashes, level L against the pairs of level L - 1, so every stored node is recomputed
once and memory stays flat whatever the log's size. A checkpoint must be signed by its log key and
name the root the tree has at its size; a receipt must be signed by its log key and name its
request's request_finished event (seq and chain hash).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import Connection, select

from loraledger.audit.queries import stream
from loraledger.errors import AuditCorruptError, EvidenceError
from loraledger.evidence import node_store, receipt, signed_note
from loraledger.evidence import tree_hash as th
from loraledger.evidence.log_tree import CHECKPOINTS
from loraledger.evidence.node_store import NODES
from loraledger.evidence.receipt import Receipt
from loraledger.evidence.receipt_store import RECEIPTS
from loraledger.evidence.signed_note import Verifier
from loraledger.evidence.tlog_checkpoint import open_checkpoint
from loraledger.store.models import Event
from loraledger.store.records import EventKind

EVENTS = Event.__table__
Report = Callable[..., None]  # (sequence, message, request_id=None, *, table=, key=) as verify's problem list takes


def check_all(conn: Connection, report: Report, *, trusted: Verifier | None = None) -> None:
    size = check_tree(conn, report)
    check_checkpoints(conn, report, size, trusted)
    check_receipts(conn, report, trusted)


def _level(conn: Connection, level: int) -> Iterator[Any]:
    return stream(conn, select(NODES.c.idx, NODES.c.hash).where(NODES.c.level == level).order_by(NODES.c.idx))


def _merge(expected: Iterator[tuple[int, str]], stored: Iterator[Any], level: int, report: Report) -> None:
    """Compare one level's expected (idx, hash) with its stored rows, both in idx order."""
    row = next(stored, None)
    for idx, digest in expected:
        while row is not None and (not isinstance(row.idx, int) or row.idx < idx):
            _extra(row, level, report)
            row = next(stored, None)
        if row is None or row.idx != idx:
            report(_seq(level, idx), f"the Merkle tree has no node ({level}, {idx}): `merkle_nodes` rows were deleted",
                   table="merkle_nodes", key={"level": level, "idx": idx})  # fmt: skip
            continue
        if row.hash != digest:
            report(_seq(level, idx), f"Merkle node ({level}, {idx}) does not hash what it covers: the tree or the events "
                   "under it were altered", table="merkle_nodes", key={"level": level, "idx": idx})  # fmt: skip
        row = next(stored, None)
    while row is not None:
        _extra(row, level, report)
        row = next(stored, None)


def _extra(row: Any, level: int, report: Report) -> None:
    report(None, f"`merkle_nodes` holds a node ({level}, {row.idx!r}) that no event accounts for",
           table="merkle_nodes", key={"level": level, "idx": row.idx if isinstance(row.idx, int) else repr(row.idx)})  # fmt: skip


def _seq(level: int, idx: int) -> int:
    """The seq of the last event a node covers: where its problem is reported."""
    return ((idx + 1) << level) if isinstance(idx, int) else 0


def check_tree(conn: Connection, report: Report) -> int:
    """Recompute every stored node; returns the tree's size (the number of events)."""
    events = stream(conn, select(EVENTS.c.seq, EVENTS.c.hash).order_by(EVENTS.c.seq))

    last = [0]

    def leaves() -> Iterator[tuple[int, str]]:
        # leaf seq - 1 for each event: a missing or misnumbered event is the chain check's to report, not every leaf's
        for ev in events:
            if not isinstance(ev.seq, int) or ev.seq < 1:
                continue
            last[0] = max(last[0], ev.seq)
            try:
                yield ev.seq - 1, node_store.leaf_of_event(ev.hash).hex()
            except (ValueError, TypeError, AttributeError):
                yield ev.seq - 1, "(the event's hash is not 32 bytes of hex)"

    _merge(leaves(), _level(conn, 0), 0, report)
    size = last[0]
    level, width = 0, size
    while width >= 2:  # a level of `width` nodes has width // 2 parents
        below = _level(conn, level)

        def parents(rows: Iterator[Any] = below) -> Iterator[tuple[int, str]]:
            left = None
            for row in rows:
                if not isinstance(row.idx, int):
                    continue
                if row.idx % 2 == 0:
                    left = row
                elif left is not None and left.idx == row.idx - 1:
                    try:
                        yield row.idx // 2, th.node_hash(bytes.fromhex(left.hash), bytes.fromhex(row.hash)).hex()
                    except (ValueError, TypeError):
                        yield row.idx // 2, "(a child's hash is not 32 bytes of hex)"
                    left = None

        level += 1
        _merge(parents(), _level(conn, level), level, report)
        width = size >> level
    stray = select(NODES.c.level, NODES.c.idx).where((NODES.c.level > level) | (NODES.c.level < 0))
    for row in stream(conn, stray.order_by(NODES.c.level, NODES.c.idx).limit(100)):
        _extra(row, row.level, report)
    return size


def _verifier(text: Any, trusted: Verifier | None) -> Verifier:
    if not isinstance(text, str):
        raise EvidenceError("its log key is not a vkey")
    key = signed_note.parse_vkey(text)
    if trusted is not None and (key.name, key.public) != (trusted.name, trusted.public):
        raise EvidenceError(f"it is signed by {text}, not by the trusted log key")
    return key


def check_checkpoints(conn: Connection, report: Report, size: int, trusted: Verifier | None) -> None:
    for row in stream(conn, select(CHECKPOINTS).order_by(CHECKPOINTS.c.tree_size)):
        key = {"tree_size": row.tree_size}
        try:
            checkpoint, _ = open_checkpoint(row.note, _verifier(row.log_key, trusted))
            if checkpoint.size != row.tree_size:
                raise EvidenceError(f"its note is of a tree of {checkpoint.size} leaves")
            if checkpoint.size > size:
                raise EvidenceError(f"the log has only {size} events: events were removed after it was signed")
            if node_store.root(conn, checkpoint.size) != checkpoint.root:
                raise EvidenceError(
                    "the log's tree at its size has another root: the log was rewritten after it was signed"
                )
        except (EvidenceError, AuditCorruptError) as exc:
            report(row.tree_size if isinstance(row.tree_size, int) else None,
                   f"the signed checkpoint of tree size {row.tree_size!r} does not check out: {exc}",
                   table="checkpoints", key=key)  # fmt: skip


def check_receipts(conn: Connection, report: Report, trusted: Verifier | None) -> None:
    e = EVENTS
    query = (
        select(RECEIPTS, e.c.kind, e.c.hash.label("event_hash"), e.c.request_id.label("event_request_id"))
        .select_from(RECEIPTS.outerjoin(e, e.c.seq == RECEIPTS.c.seq))
        .order_by(RECEIPTS.c.seq)
    )
    for row in stream(conn, query):
        rid = row.request_id
        try:
            _verifier(row.log_key, trusted)
            body = receipt.check_signature(Receipt(body=row.body, signature=row.signature, log_key=row.log_key))
            if body.get("audit_key") != rid or body.get("seq") != row.seq or body.get("leaf_index") != row.seq - 1:
                raise EvidenceError("its row's request_id or seq differs from what its signed body says")
            if row.kind != EventKind.REQUEST_FINISHED or row.event_request_id != rid:
                raise EvidenceError(f"event {row.seq!r} is not the request_finished event of {rid!r}")
            if body.get("event_hash") != row.event_hash:
                raise EvidenceError(
                    f"event {row.seq}'s hash differs from the one the receipt names: the event was rewritten"
                )
        except (EvidenceError, TypeError, ValueError) as exc:
            report(row.seq if isinstance(row.seq, int) else None, f"the receipt of {rid!r} does not check out: {exc}",
                   rid, table="receipts", key={"request_id": rid})  # fmt: skip
