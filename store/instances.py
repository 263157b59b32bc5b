"""Engine instances in the audit database: the `instances` row and its instance_registered event, and the lease each renews.

Several engines may share one audit database. Each registers at start (a row in `instances`, on the
hash chain through its instance_registered event, like an adapter's row) and holds a lease in
`instance_leases` that it renews while it runs. Lease times are the database's clock, never the
engines' own, so hosts whose clocks disagree still agree on who has expired. A lease that has
expired may be claimed by another instance, once (`claim_expired`, under the writers' lock): the
claimer records the expired instance's unfinished requests as interrupted, and from then on the
expired instance may write nothing more (`ensure_writable`), so a stalled engine that wakes up
cannot put outputs on record for requests already recorded as interrupted. An instance whose process
is certainly gone (store/process_identity.py: same machine, no such process any more) may be claimed
before its lease expires, so an engine restarted on the machine where it crashed recovers at once.
A clean stop ends the lease as "stopped" (nothing to recover), and puts an instance_stopped event on the chain in
the same transaction: the lease row is mutable, the chain is not, so verify finds a stop marker erased (the instance
would look crashed and be "recovered") or forged (a crashed instance's unfinished requests hidden from recovery).
One that left requests unfinished (its store did not answer at stop) ends it as expired, for the next instance to
recover.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec
from sqlalchemy import Connection, Select, Table, Text, insert, literal, select, text, update

from loraledger.digests import registration_digest
from loraledger.errors import InstanceLeaseLostError
from loraledger.store import process_identity
from loraledger.store.models import Instance, InstanceLease, utc_from_unix
from loraledger.store.records import EventKind, EventRecord
from loraledger.store.registration import registered_form

INSTANCES: Table = Instance.__table__  # type: ignore[assignment]
LEASES: Table = InstanceLease.__table__  # type: ignore[assignment]
KEY_PREFIX = "instance:"  # dedup_key of the instance_registered event: KEY_PREFIX + instance id
STOP_KEY_PREFIX = "stopped:"  # dedup_key of the instance_stopped event: STOP_KEY_PREFIX + instance id
TOOL_CLAIMER = "(a tool)"
SOURCE_FIELDS = (
    "model",
    "model_repo_id",
    "model_revision",
    "model_commit_sha",
    "tokenizer",
    "tokenizer_repo_id",
    "tokenizer_revision",
    "tokenizer_commit_sha",
    "quantization",
    "quant_method",
    "quant_bits",
    "quant_group_size",
    "quant_source_fingerprint",
)
# revision 0015's columns: written only when set, so a float model's row (and its event) is what it was before 0015
QUANT_FIELDS = SOURCE_FIELDS[
    -5:
]  # recovered_by of a lease claimed by a tool (no instance of its own): its events name none


class InstanceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Who an engine is, as it registers: the `instances` row."""

    instance_id: str
    host: str
    pid: int
    engine_version: str
    started_at: float  # unix time (the database's clock, set at registration)
    lease_seconds: float
    # the base model and tokenizer as given, and their Hub source (repo, revision asked, commit sha read; None: local)
    model: str | None = None
    model_repo_id: str | None = None
    model_revision: str | None = None
    model_commit_sha: str | None = None
    tokenizer: str | None = None
    tokenizer_repo_id: str | None = None
    tokenizer_revision: str | None = None
    tokenizer_commit_sha: str | None = None
    # how the base model's weights are quantized as served (None: float): QuantScheme.describe(), its method, bits
    # and group size (None: per channel)
    quantization: str | None = None
    quant_method: str | None = None
    quant_bits: int | None = None
    quant_group_size: int | None = None
    quant_source_fingerprint: str | None = None  # quantized at load: the float checkpoint's base-model fingerprint


class LeaseState(msgspec.Struct, frozen=True, kw_only=True):
    """An instance and its lease as `audit instances` shows them."""

    instance: InstanceRecord
    expires_at: float | None  # None: no lease row (cannot happen for an instance registered by an engine)
    recovered_by: str | None
    recovered_at: float | None
    now: float  # the database's clock when read

    @property
    def state(self) -> str:
        """live, expired (a peer will recover it), stopped (cleanly, nothing left) or recovered (by a peer)."""
        if self.recovered_by == self.instance.instance_id:
            return "stopped"
        if self.recovered_by is not None:
            return "recovered"
        if self.expires_at is None or self.expires_at <= self.now:
            return "expired"
        return "live"


def new_instance_id() -> str:
    """An id no other engine start anywhere will make: the UTC second it was made (so ids sort by start) and 64 random bits."""
    return f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:16]}"


def this_instance(engine_version: str, lease_seconds: float) -> InstanceRecord:
    """A new InstanceRecord for this process (started_at is set by the database at registration)."""
    return InstanceRecord(
        instance_id=new_instance_id(),
        host=socket.gethostname(),
        pid=os.getpid(),
        engine_version=engine_version,
        started_at=0.0,
        lease_seconds=float(lease_seconds),
    )


def registration_key(instance_id: str) -> str:
    return KEY_PREFIX + instance_id


def db_now(conn: Connection) -> float:
    """The database's clock, unix seconds (the one clock every instance's lease is measured by)."""
    if conn.dialect.name == "postgresql":
        return float(conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())
    return float(conn.execute(text("SELECT (julianday('now') - 2440587.5) * 86400.0")).scalar_one())


def instance_row(record: InstanceRecord) -> dict[str, Any]:
    return {
        "instance_id": record.instance_id,
        "host": record.host,
        "pid": record.pid,
        "engine_version": record.engine_version,
        "started_at": utc_from_unix(record.started_at),
        "lease_seconds": float(record.lease_seconds),
        **{
            name: getattr(record, name)
            for name in SOURCE_FIELDS
            if name not in QUANT_FIELDS or getattr(record, name) is not None
        },
    }


def instance_record(row: Any) -> InstanceRecord:
    return InstanceRecord(
        instance_id=row.instance_id,
        host=row.host,
        pid=row.pid,
        engine_version=row.engine_version,
        started_at=row.started_at.timestamp(),
        lease_seconds=row.lease_seconds,
        **{name: getattr(row, name) for name in SOURCE_FIELDS},
    )


def registration_event(row: Mapping[str, Any]) -> EventRecord:
    """The instance_registered event that puts an `instances` row on the chain (verify compares the two)."""
    instance = registered_form(row)
    return EventRecord(
        kind=EventKind.INSTANCE_REGISTERED,
        at=float(instance["started_at"]),
        payload={"instance": instance, "instance_sha256": registration_digest(instance)},
        dedup_key=registration_key(str(instance["instance_id"])),
    )


def register(conn: Connection, record: InstanceRecord) -> tuple[InstanceRecord, EventRecord]:
    """Insert the instance's row and its first lease (inside db.write_transaction); returns the record as
    registered (started_at by the database's clock) and the event that must be appended with it."""
    now = db_now(conn)
    registered = msgspec.structs.replace(record, started_at=utc_from_unix(now).timestamp())
    row = instance_row(registered)
    conn.execute(insert(INSTANCES), [row])
    lease = {
        "instance_id": record.instance_id,
        "expires_at": utc_from_unix(now + record.lease_seconds),
        "process_key": process_identity.process_key(),
        "recovered_by": None,
        "recovered_at": None,
    }
    conn.execute(insert(LEASES), [lease])
    process_identity.mark_running(record.instance_id, True)
    return registered, registration_event(row)


def renew(conn: Connection, instance_id: str, lease_seconds: float) -> float:
    """Extend the lease to lease_seconds from now (database clock); returns the new expiry.

    Raises InstanceLeaseLostError when another instance has recovered this one (its lease had expired):
    it must stop, because its unfinished requests are already on record as interrupted."""
    now = db_now(conn)
    expires = now + lease_seconds
    done = conn.execute(
        update(LEASES)
        .where(LEASES.c.instance_id == instance_id, LEASES.c.recovered_by.is_(None))
        .values(expires_at=utc_from_unix(expires))
    ).rowcount
    if done != 1:
        raise InstanceLeaseLostError(_lost(conn, instance_id))
    return expires


def release(conn: Connection, instance_id: str, unfinished: bool) -> list[EventRecord]:
    """End the lease now, at a stop: "stopped" when the instance left nothing unfinished, else expired, so that
    a peer recovers what is left at once instead of waiting for the lease to run out. Returns the events to append
    in the same transaction: the instance_stopped event of a clean stop (none otherwise, or when a peer had
    recovered the instance already)."""
    clock = db_now(conn)
    now = utc_from_unix(clock)
    values: dict[str, Any] = {"expires_at": now}
    if not unfinished:
        values.update(recovered_by=instance_id, recovered_at=now)
    done = conn.execute(
        update(LEASES).where(LEASES.c.instance_id == instance_id, LEASES.c.recovered_by.is_(None)).values(values)
    ).rowcount
    if unfinished or done != 1:
        return []
    return [stop_event(instance_id, clock)]


def stop_event(instance_id: str, at: float) -> EventRecord:
    """The instance_stopped event that vouches for a clean stop's lease marker."""
    return EventRecord(
        kind=EventKind.INSTANCE_STOPPED,
        at=at,
        payload={"instance_id": instance_id},
        dedup_key=STOP_KEY_PREFIX + instance_id,
    )


def ensure_writable(conn: Connection, instance_id: str) -> None:
    """Refuse (InstanceLeaseLostError) a write by an instance another one has recovered (inside the write transaction,
    so that no write can slip in after the recovery that would make it a lie)."""
    row = conn.execute(select(LEASES.c.recovered_by).where(LEASES.c.instance_id == instance_id)).first()
    if row is None or row.recovered_by is not None:
        raise InstanceLeaseLostError(_lost(conn, instance_id))


def _lost(conn: Connection, instance_id: str) -> str:
    row = conn.execute(select(LEASES).where(LEASES.c.instance_id == instance_id)).first()
    if row is None:
        return f"engine instance {instance_id} has no lease in the audit database (was it registered there?); start a new engine"
    return (
        f"engine instance {instance_id} lost its lease: it was not renewed before {row.expires_at.isoformat()}, and instance "
        f"{row.recovered_by} recovered it at {row.recovered_at.isoformat()} (its unfinished requests are on record as "
        "interrupted); this engine writes nothing more: start a new one, and give audit_lease_seconds more room if renewals are slow"
    )


def claimable(conn: Connection, claimer: str | None) -> list[str]:
    """The instances (other than claimer) no one has recovered yet whose lease has expired, or whose process is
    certainly gone; oldest lease first. Read alone it is a hint; claim_expired reads it again under the lock."""
    now = db_now(conn)
    open_leases = conn.execute(
        select(LEASES.c.instance_id, LEASES.c.expires_at, LEASES.c.process_key)
        .where(LEASES.c.recovered_by.is_(None), LEASES.c.instance_id != (claimer or ""))
        .order_by(LEASES.c.expires_at, LEASES.c.instance_id)
    ).all()
    return [
        row.instance_id
        for row in open_leases
        if row.expires_at.timestamp() <= now or process_identity.certainly_gone(row.instance_id, row.process_key)
    ]


def claim_expired(conn: Connection, claimer: str | None) -> list[str]:
    """Mark every claimable instance as recovered by claimer (inside db.write_transaction, so two claimers never
    both get one); returns their ids."""
    expired = claimable(conn, claimer)
    if expired:
        conn.execute(
            update(LEASES)
            .where(LEASES.c.instance_id.in_(expired), LEASES.c.recovered_by.is_(None))
            .values(recovered_by=claimer or TOOL_CLAIMER, recovered_at=utc_from_unix(db_now(conn)))
        )
    return expired


def recovered_leases() -> Select[Any]:
    """(instance_id, recovered_by) of every lease a peer (or a tool) claimed, not ended by its own instance's stop."""
    return (
        select(LEASES.c.instance_id, LEASES.c.recovered_by)
        .where(LEASES.c.recovered_by.is_not(None), LEASES.c.recovered_by != LEASES.c.instance_id)
        .order_by(LEASES.c.instance_id)
    )


def lease_states(conn: Connection) -> list[LeaseState]:
    """Every instance with its lease, oldest start first."""
    now = db_now(conn)
    query = (
        select(INSTANCES, LEASES.c.expires_at, LEASES.c.recovered_by, LEASES.c.recovered_at)
        .select_from(INSTANCES.outerjoin(LEASES, LEASES.c.instance_id == INSTANCES.c.instance_id))
        .order_by(INSTANCES.c.started_at, INSTANCES.c.instance_id)
    )
    return [
        LeaseState(
            instance=instance_record(row),
            expires_at=None if row.expires_at is None else row.expires_at.timestamp(),
            recovered_by=row.recovered_by,
            recovered_at=None if row.recovered_at is None else row.recovered_at.timestamp(),
            now=now,
        )
        for row in conn.execute(query)
    ]


def is_registered(instances: Table | Any, events: Table | Any) -> Any:
    """SQL: the instances row has its instance_registered event (found through the event's unique dedup_key)."""
    key = literal(KEY_PREFIX, Text) + instances.c.instance_id
    return (
        select(events.c.seq).where(events.c.dedup_key == key, events.c.kind == EventKind.INSTANCE_REGISTERED).exists()
    )


def _unvouched_marker(events: Table) -> tuple[Any, Any]:
    """SQL conditions on a lease: it carries the clean-stop marker, and no instance_stopped event vouches for it."""
    stop_key = literal(STOP_KEY_PREFIX, Text) + LEASES.c.instance_id
    vouched = select(events.c.seq).where(events.c.dedup_key == stop_key, events.c.kind == EventKind.INSTANCE_STOPPED)
    return LEASES.c.recovered_by == LEASES.c.instance_id, ~vouched.exists()


def unvouched_stops(events: Table) -> Select[Any]:
    """(instance_id, problem) of every clean-stop lease marker the chain does not vouch for, and of every
    instance_stopped event whose lease no longer carries the marker (erased, altered, or the lease row deleted)."""
    forged = select(LEASES.c.instance_id, literal("forged", Text).label("problem")).where(*_unvouched_marker(events))
    marked = (
        select(LEASES.c.instance_id)
        .where(LEASES.c.instance_id == events.c.instance_id, LEASES.c.recovered_by == LEASES.c.instance_id)
        .exists()
    )
    erased = select(events.c.instance_id, literal("erased", Text).label("problem")).where(
        events.c.kind == EventKind.INSTANCE_STOPPED, ~marked
    )
    return forged.union_all(erased)


def unregistered(instances: Table, events: Table) -> Select[Any]:
    """The `instances` rows no instance_registered event vouches for."""
    return select(instances.c.instance_id).where(~is_registered(instances, events)).order_by(instances.c.instance_id)


def unvouched_stop_markers(conn: Connection, events: Table) -> list[str]:
    """Instances whose lease carries a clean-stop marker no instance_stopped event vouches for (stops written
    before clean stops went on the chain), oldest stop first."""
    query = (
        select(LEASES.c.instance_id)
        .where(*_unvouched_marker(events))
        .order_by(LEASES.c.recovered_at, LEASES.c.instance_id)
    )
    return list(conn.execute(query).scalars())


def backfilled_stop_event(instance_id: str, at: float, revision: str) -> EventRecord:
    """The instance_stopped event a revision appends for a clean stop that was on record before such events were."""
    event = stop_event(instance_id, at)
    return msgspec.structs.replace(event, payload={**event.payload, "backfilled_by": revision})
