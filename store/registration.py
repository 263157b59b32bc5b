"""Adapter rows in the hash chain: each `adapters` row is vouched for by one adapter_registered event.

The store appends the event in the transaction that inserts the row (the first time a fingerprint
is written), so the rows an auditor's "which adapter wrote this answer?" query reads are facts the
chain covers. Revision 0004 appended the events of rows written before it. `loraledger audit
verify` compares each row, column by column, with its event's payload.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Select, Table, Text, literal, select

from loraledger.digests import registration_digest
from loraledger.store.records import EventKind, EventRecord

KEY_PREFIX = "adapter:"  # dedup_key of the event: KEY_PREFIX + fingerprint


def registration_key(fingerprint: str) -> str:
    return KEY_PREFIX + fingerprint


def registered_form(row: Mapping[str, Any]) -> dict[str, Any]:
    """An `adapters` row (column -> value) as its adapter_registered event carries it: times as unix seconds.

    Every column is carried, so a column added to the table later is covered without a change here.
    """
    return {name: value.timestamp() if isinstance(value, dt.datetime) else value for name, value in row.items()}


def registration_event(row: Mapping[str, Any], *, at: float, backfilled_by: str | None = None) -> EventRecord:
    """The adapter_registered event for an `adapters` row (as store.rows.adapter_row makes it, or as read back)."""
    adapter = registered_form(row)
    payload: dict[str, Any] = {"adapter": adapter, "adapter_sha256": registration_digest(adapter)}
    if backfilled_by is not None:
        payload["backfilled_by"] = backfilled_by  # the revision that put a row written before it on the chain
    return EventRecord(
        kind=EventKind.ADAPTER_REGISTERED,
        at=at,
        payload=payload,
        dedup_key=registration_key(str(adapter["fingerprint"])),
    )


def is_registered(adapters: Table | Any, events: Table | Any) -> Any:
    """SQL: the adapters row has its adapter_registered event (found through the event's unique dedup_key)."""
    key = literal(KEY_PREFIX, Text) + adapters.c.fingerprint
    return select(events.c.seq).where(events.c.dedup_key == key, events.c.kind == EventKind.ADAPTER_REGISTERED).exists()


def unregistered(adapters: Table, events: Table) -> Select[Any]:
    """The `adapters` rows no adapter_registered event vouches for, oldest first."""
    return (
        select(adapters).where(~is_registered(adapters, events)).order_by(adapters.c.first_seen, adapters.c.fingerprint)
    )
