"""The event hash chain: each event's hash covers its fields and the previous event's hash.

DESIGN: several engines, one chain. Every engine sharing an audit database appends to one chain,
its appends serialized by the database: each group commit runs in `db.write_transaction`, which
takes PostgreSQL's transaction-scoped advisory lock (SQLite: BEGIN IMMEDIATE, the file's write
lock), reads the head, chains its events on and commits before the next writer can read the head.
So sequence numbers stay gap-free and every prev_hash is the hash of the event before it, whatever
the number of writers; each event names the instance that wrote it (`instance_id`, hashed), so a
per-instance view is a filter over the one chain, not a second structure to reconcile.
The alternative, a chain per instance with a signed head over all, would let writers append in
parallel, but verify would need every instance's head and a key to trust, and "the log" would stop
being one sequence an auditor can read in order. The price of serializing is one lock hand-over per
group commit, which the group commit shares among every record in it, and the lock is held only for
the chain's part of it on PostgreSQL: a writer inserts its own requests and completions rows first
and takes the lock just before it reads the head (a batch registering an adapter takes it first,
since two instances may register one adapter at once). `python -m bench.run --only audit-chain`
measures events/s with 1 and 4 writer processes (bench/RESULTS.md, "Several writers, one chain").
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

from loraledger.store.canonical import canonical_json

GENESIS_HASH = "0" * 64  # prev_hash of event seq 1


class EventFields(NamedTuple):
    """The hashed fields of one `events` row, in hash order."""

    seq: int
    at: dt.datetime
    kind: str
    request_id: str | None
    payload: dict[str, Any]
    dedup_key: str | None
    instance_id: str | None = None  # revision 0007; hashed only when set, so rows written before it verify unchanged


class ChainedRow(Protocol):
    """What verify_chain reads from each row: an `events` row (a SQLAlchemy Row fits)."""

    seq: int
    at: dt.datetime
    kind: str
    request_id: str | None
    payload: dict[str, Any]
    dedup_key: str | None
    instance_id: str | None
    prev_hash: str
    hash: str


class ChainBreak(NamedTuple):
    """Where and why the chain first fails to verify."""

    seq: int
    reason: str


def hashed_fields(fields: EventFields | tuple[Any, ...]) -> list[Any]:
    """What an event's hash covers: [seq, at, kind, request_id, payload, dedup_key], and instance_id
    after them when the event has one (the one place the chain's row form is defined)."""
    values = list(fields)
    if len(values) > 6 and values[6] is None:
        del values[6:]
    return values


def event_hash(prev_hash: str, fields: EventFields | tuple[Any, ...]) -> str:
    """sha256 hex of prev_hash (as ASCII hex) followed by canonical_json(hashed_fields(fields))."""
    h = hashlib.sha256(prev_hash.encode("ascii"))
    h.update(canonical_json(hashed_fields(fields)))
    return h.hexdigest()


def first_break(rows: Iterable[ChainedRow], *, after_seq: int = 0, after_hash: str = GENESIS_HASH) -> ChainBreak | None:
    """The first place the chain breaks, reading rows in seq order one at a time, or None.

    Starts after (after_seq, after_hash): the genesis by default, or a trusted checkpoint.
    A missing row is reported at the missing seq; an altered row at its own seq.
    """
    expected_seq, prev = after_seq + 1, after_hash
    for row in rows:
        if row.seq != expected_seq:
            return ChainBreak(expected_seq, f"expected seq {expected_seq}, found seq {row.seq}: rows are missing")
        if row.prev_hash != prev:
            return ChainBreak(row.seq, "prev_hash does not match the previous event's hash")
        fields = EventFields(
            row.seq, row.at, row.kind, row.request_id, row.payload, row.dedup_key, getattr(row, "instance_id", None)
        )
        if event_hash(prev, fields) != row.hash:
            return ChainBreak(row.seq, "hash does not match the event's contents")
        expected_seq, prev = expected_seq + 1, row.hash
    return None


def verify_chain(rows: Iterable[ChainedRow], *, after_seq: int = 0, after_hash: str = GENESIS_HASH) -> int | None:
    """The first bad seq (see first_break), or None if every row verifies."""
    found = first_break(rows, after_seq=after_seq, after_hash=after_hash)
    return None if found is None else found.seq
