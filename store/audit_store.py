"""AuditStore: writes AuditBatches to the audit database in one transaction each, and reads back what recovery needs."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from sqlalchemy import Connection, Engine, Table, false, insert, inspect, select, true
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL

from loraledger.digests import GENESIS_HASH, ChainBreak, EventFields, event_hash, first_break, json_roundtrip
from loraledger.errors import AuditIntegrityError, AuditUnavailableError, DuplicateRequestError
from loraledger.evidence import node_store
from loraledger.store import instances, process_identity, texts
from loraledger.store.db import (
    display_url,
    make_engine,
    pg_connect_timeout,
    take_writer_lock,
    unavailable_as_error,
    write_transaction,
)
from loraledger.store.deadline import Operation, Watchdog
from loraledger.store.instances import InstanceRecord, LeaseState
from loraledger.store.migrate import ensure_schema
from loraledger.store.models import Adapter, Completion, Event, Request, utc_from_unix
from loraledger.store.records import (
    AdapterRecord,
    AuditBatch,
    Checkpoint,
    CompletionRecord,
    EventKind,
    EventRecord,
    RequestRecord,
)
from loraledger.store.registration import registration_event, unregistered
from loraledger.store.rows import adapter_row, completion_row, request_record, request_row

if TYPE_CHECKING:
    from loraledger.evidence.log_key import LogKey
    from loraledger.evidence.receipt import Receipt

ADAPTERS: Table = Adapter.__table__  # type: ignore[assignment]
REQUESTS: Table = Request.__table__  # type: ignore[assignment]
COMPLETIONS: Table = Completion.__table__  # type: ignore[assignment]
EVENTS: Table = Event.__table__  # type: ignore[assignment]

INTERRUPTED_KEY = "interrupted:{}"  # the dedup key keeps a retried recovery from writing the event twice
_IN_CHUNK = 500  # keys per IN (...) list: well inside SQLite's and PostgreSQL's parameter limits
OPEN_TIMEOUT_S = 30.0  # open checks the schema (and migrates a new database): at least this long a deadline
SCAN_TIMEOUT_S = 120.0  # recovery's reads, which scan the whole log at start


def _chunks(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), _IN_CHUNK):
        yield items[start : start + _IN_CHUNK]


def _differences(new: dict[str, Any], old: dict[str, Any]) -> list[str]:
    return [key for key, value in new.items() if old[key] != value]


def _insert_adapters(conn: Connection, records: Sequence[AdapterRecord]) -> list[dict[str, Any]]:
    """Insert the adapters not yet on record; returns their rows, in the order first given."""
    rows: dict[str, AdapterRecord] = {}
    for r in records:
        rows.setdefault(r.fingerprint, r)  # the first record of a fingerprint wins
    if not rows:
        return []
    existing = _existing(conn, ADAPTERS.c.fingerprint, list(rows))
    new = [adapter_row(r) for key, r in rows.items() if key not in existing]
    if new:
        conn.execute(insert(ADAPTERS), new)
    return new


def _insert_requests(conn: Connection, records: Sequence[RequestRecord], instance_id: str | None) -> None:
    rows: dict[str, dict[str, Any]] = {}
    for record in records:
        row = request_row(record)
        if instance_id is not None:  # a tool writes no instance (nor the column, which a log before 0007 lacks)
            row["instance_id"] = instance_id
        seen = rows.setdefault(record.request_id, row)
        if seen is not row and seen != row:
            raise DuplicateRequestError(
                f"request id {record.request_id!r} appears twice in one audit batch with different "
                f"bindings ({', '.join(_differences(row, seen))} differ); every request needs its own id"
            )
    if not rows:
        return
    on_record: dict[str, dict[str, Any]] = {}
    for chunk in _chunks(list(rows)):
        for old in conn.execute(select(REQUESTS).where(REQUESTS.c.request_id.in_(chunk))).mappings():
            on_record[old["request_id"]] = dict(old)
    for request_id, old in on_record.items():
        # the instance that first admitted a request keeps it: a retry by another instance is the same binding
        changed = [key for key in _differences(rows[request_id], old) if key != "instance_id"]
        if changed:
            raise DuplicateRequestError(
                f"request id {request_id!r} is already in the audit log with a different binding "
                f"({', '.join(changed)} differ); use a new request id"
            )
    new = [row for key, row in rows.items() if key not in on_record]
    if new:
        conn.execute(insert(REQUESTS), new)


def _insert_completions(conn: Connection, records: Sequence[CompletionRecord]) -> None:
    rows = {(r.request_id, r.index): r for r in reversed(records)}
    if not rows:
        return
    request_ids = sorted({request_id for request_id, _ in rows})
    existing: set[tuple[str, int]] = set()
    for chunk in _chunks(request_ids):
        query = select(COMPLETIONS.c.request_id, COMPLETIONS.c.completion_index).where(
            COMPLETIONS.c.request_id.in_(chunk)
        )
        existing.update((row.request_id, row.completion_index) for row in conn.execute(query))
    new = [completion_row(r) for key, r in rows.items() if key not in existing]
    if new:
        conn.execute(insert(COMPLETIONS), new)


def append_events(
    conn: Connection,
    records: Sequence[EventRecord],
    instance_id: str | None = None,
    *,
    merkle: bool = True,
    appended: list[dict[str, Any]] | None = None,
) -> Checkpoint:
    """Chain records onto the event log on conn (inside db.write_transaction), skipping dedup keys on record;
    each event names instance_id, the engine instance writing it (None: a tool). merkle: also append their leaves
    to the Merkle tree (False only for a revision that runs before the tree exists). appended: gets the rows chained."""
    head = _head(conn)
    keys = [r.dedup_key for r in records if r.dedup_key is not None]
    skip = _existing(conn, EVENTS.c.dedup_key, keys) if keys else set()
    seq, prev = head.sequence, head.hash
    rows: list[dict[str, Any]] = []
    for record in records:
        if record.dedup_key is not None:
            if record.dedup_key in skip:
                continue
            skip.add(record.dedup_key)
        seq += 1
        fields = EventFields(
            seq=seq,
            at=utc_from_unix(record.at),
            kind=record.kind,
            request_id=record.request_id,
            payload=json_roundtrip(record.payload),
            dedup_key=record.dedup_key,
            instance_id=instance_id,
        )
        digest = event_hash(prev, fields)
        row = {**fields._asdict(), "prev_hash": prev, "hash": digest}
        if instance_id is None:  # as for requests: a log before 0007 has no such column
            del row["instance_id"]
        rows.append(row)
        prev = digest
    if not rows:
        return head
    conn.execute(insert(EVENTS), rows)
    if merkle:
        node_store.append_leaves(conn, head.sequence, [row["hash"] for row in rows])
    if appended is not None:
        appended.extend(rows)
    return Checkpoint(sequence=seq, hash=prev, at=rows[-1]["at"].timestamp())


def _existing(conn: Connection, column: Any, keys: Sequence[Any]) -> set[Any]:
    found: set[Any] = set()
    for chunk in _chunks(list(keys)):
        found.update(conn.execute(select(column).where(column.in_(chunk))).scalars())
    return found


def _head(conn: Connection) -> Checkpoint:
    row = conn.execute(select(EVENTS.c.seq, EVENTS.c.hash, EVENTS.c.at).order_by(EVENTS.c.seq.desc()).limit(1)).first()
    if row is None:
        return Checkpoint(sequence=0, hash=GENESIS_HASH, at=0.0)
    return Checkpoint(sequence=row.seq, hash=row.hash, at=row.at.timestamp())


def _root_reason(exc: BaseException) -> str:
    """The first line of what the driver said, under the wrappers."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def write_batch(
    conn: Connection,
    batch: AuditBatch,
    instance_id: str | None = None,
    *,
    log_key: LogKey | None = None,
    receipts: dict[str, Receipt] | None = None,
) -> Checkpoint:
    """Write batch on conn, which must be inside db.write_transaction (AuditStore.write does that).

    An adapter written for the first time enters the chain in the same transaction: its
    adapter_registered event comes before the batch's own events (which may name it).
    instance_id: the engine instance writing (its requests rows and events carry it); an instance
    another one has recovered is refused (InstanceLeaseLostError). None: a tool, no instance.
    log_key: sign a receipt for each request this batch finishes, kept in `receipts` and put in receipts (by audit key).
    """
    registered = _insert_adapters(conn, batch.adapters)
    _insert_requests(conn, batch.requests, instance_id)
    _insert_completions(conn, batch.completions)
    texts.insert_texts(conn, batch.texts)
    # the chain's turn: from here to the commit, no other writer appends (see store/db.py)
    take_writer_lock(conn)
    texts.refuse_after_erasure(conn, batch)  # an erase committed before this lock is seen here
    if instance_id is not None:
        instances.ensure_writable(conn, instance_id)
    events = [registration_event(row, at=row["first_seen"].timestamp()) for row in registered]
    appended: list[dict[str, Any]] = []
    head = append_events(conn, [*events, *batch.events], instance_id, appended=appended)
    if log_key is not None:
        from loraledger.evidence import receipt_store  # here: the evidence package imports the store

        issued = receipt_store.issue(conn, log_key, batch, appended)
        if receipts is not None:
            receipts.update(issued)
    return head


def _unfinished(conn: Connection, owners: Any) -> list[RequestRecord]:
    """Requests whose instance matches owners (a SQL condition on requests.instance_id) with no terminal event, oldest first."""
    terminal = (
        select(EVENTS.c.seq)
        .where(EVENTS.c.request_id == REQUESTS.c.request_id, EVENTS.c.kind.in_(sorted(EventKind.TERMINAL)))
        .exists()
    )
    query = select(REQUESTS).where(owners, ~terminal).order_by(REQUESTS.c.received_at, REQUESTS.c.request_id)
    return [request_record(row) for row in conn.execute(query)]


def recover_expired(conn: Connection, claimer: str | None, *, at: float, resume: bool, unowned: bool) -> Recovery:
    """Claim every instance whose lease has expired and record its unfinished requests as interrupted, in one
    transaction under the writers' lock (inside db.write_transaction): a second recoverer finds them claimed and
    their requests ended. unowned: also the unfinished requests no instance owns (written before revision 0007)."""
    if claimer is not None:  # an instance a peer has recovered recovers no one
        instances.ensure_writable(conn, claimer)
    claimed = instances.claim_expired(conn, claimer)
    owners = REQUESTS.c.instance_id.in_(claimed) if claimed else false()
    if unowned:
        owners = owners | REQUESTS.c.instance_id.is_(None)
    unfinished = _unfinished(conn, owners) if claimed or unowned else []
    if not unfinished and not claimed:
        return Recovery(instances=[], requests=[])
    events = [
        EventRecord(
            kind=EventKind.REQUEST_INTERRUPTED,
            at=at,
            request_id=r.request_id,
            payload={
                "reason": "the engine stopped before the request finished (killed, crashed, or stopped while its audit store did not answer)"
            },
            dedup_key=INTERRUPTED_KEY.format(r.request_id),
        )
        for r in unfinished
    ]
    recovered = {"interrupted": [r.request_id for r in unfinished], "resume": resume, "instances": claimed}
    events.append(EventRecord(kind=EventKind.ENGINE_RECOVERED, at=at, payload=recovered))
    append_events(conn, events, claimer)
    return Recovery(instances=claimed, requests=unfinished)


def backfill_registrations(conn: Connection, revision: str) -> int:
    """Append an adapter_registered event for every `adapters` row that has none (rows written before
    adapters entered the chain); returns how many. Runs inside db.write_transaction (the migration's)."""
    now = time.time()
    # the columns the table has at the revision running this (a later revision may add more to the model)
    present = {c["name"] for c in inspect(conn).get_columns("adapters")}
    query = unregistered(ADAPTERS, EVENTS).with_only_columns(*(c for c in ADAPTERS.c if c.name in present))
    rows = [dict(row._mapping) for row in conn.execute(query)]
    if rows:
        # revision 0004 runs before the Merkle tree exists: revision 0009 builds it over these events
        append_events(conn, [registration_event(row, at=now, backfilled_by=revision) for row in rows], merkle=False)
    return len(rows)


class Recovery(msgspec.Struct, frozen=True, kw_only=True):
    """What one recovery claimed: the expired instances, and their requests now on record as interrupted."""

    instances: list[str]
    requests: list[RequestRecord]


class AuditStore:
    """The audit database, opened at a URL (SQLite file or PostgreSQL).

    `open()` connects and checks the schema (migrating a brand-new empty database); `write()`
    commits one AuditBatch atomically and idempotently. Failures to reach the database raise
    AuditUnavailableError and leave nothing of the batch behind.

    timeout (seconds; the engine's audit_timeout): the deadline of each operation, from checking
    out a connection to the commit. A database that does not answer within it (down, hung, or a
    network partition) is unreachable: AuditUnavailableError, as for a refused connection. None:
    no deadline (tools and tests).

    An engine's store also registers the engine as an instance (`register`), renews its lease
    (`renew_lease`) and stamps its instance id on every requests row and event it writes; a store
    that has registered no instance writes rows with none (tools, and logs written before 0007).
    """

    def __init__(self, url: str | URL, *, timeout: float | None = None):
        self.url = url
        self.timeout = timeout
        self.instance: InstanceRecord | None = None
        self.log_key: LogKey | None = None  # set: every finished request gets a signed receipt (loraledger/evidence/)
        self._engine: Engine | None = None
        self._watchdog: Watchdog | None = None

    def open(self) -> AuditStore:
        if self._engine is None:
            with unavailable_as_error(self.url):
                self._engine = make_engine(self.url, timeout=self.timeout)
            if self.timeout is not None:
                self._watchdog = Watchdog(self._engine, connect_timeout=pg_connect_timeout(self.timeout))
        try:
            with self._operation(deadline := self._at_least(OPEN_TIMEOUT_S)):
                ensure_schema(self._engine, self.url, deadline_s=deadline)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self.instance is not None:  # its engine no longer runs in this process: a restart may recover it at once
            process_identity.mark_running(self.instance.instance_id, False)
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def __enter__(self) -> AuditStore:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise AuditUnavailableError(f"the audit store at {display_url(self.url)} is not open: call open() first")
        return self._engine

    def _at_least(self, seconds: float) -> float | None:
        return None if self.timeout is None else max(self.timeout, seconds)

    @contextlib.contextmanager
    def _operation(self, seconds: float | None) -> Iterator[Operation | None]:
        """One unit of store work under a deadline of seconds; reaching or using the database failing,
        or the deadline passing, raises AuditUnavailableError."""
        deadline = self._watchdog.deadline(seconds) if self._watchdog is not None else contextlib.nullcontext()
        with deadline as op:
            try:
                with unavailable_as_error(self.url):
                    yield op
            except (AuditUnavailableError, sa_exc.SQLAlchemyError) as exc:
                if op is None or not op.expired:
                    raise
                raise AuditUnavailableError(
                    f"the audit store at {display_url(self.url)} did not answer within {seconds:g} s "
                    f"(audit_timeout), so it is treated as unreachable ({_root_reason(exc)})"
                ) from exc

    @contextlib.contextmanager
    def _reading(self, seconds: float | None) -> Iterator[Connection]:
        """A connection for reads under a deadline of seconds (longer than the writes' for scans of the whole log)."""
        with self._operation(seconds), self.engine.connect() as conn:
            if conn.dialect.name == "postgresql" and self.timeout is not None and seconds != self.timeout:
                # the session's statement_timeout is the writes' deadline; this transaction may take longer
                ms = 0 if seconds is None else round(seconds * 1000)
                conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")
            yield conn

    # -- writing ---------------------------------------------------------------------------

    def write(self, batch: AuditBatch, receipts: dict[str, Receipt] | None = None) -> Checkpoint:
        """Commit the batch in one transaction; returns the event chain's head after it.

        Adapters, requests and completions already on record are skipped (a request id on record
        with a different binding raises DuplicateRequestError); events whose dedup_key is on
        record are skipped. So a batch retried after an ambiguous failure is written once. An
        AuditUnavailableError says whether the failure was ambiguous: `maybe_committed` is False
        when it came before the commit was sent. With a log_key set, the receipts of the requests the batch
        finishes are signed in the transaction and put in receipts (valid only once this returns: committed).
        """
        engine = self.engine
        committing = False
        try:
            with self._operation(self.timeout) as op:
                try:
                    # a batch with adapters takes its turn first: two instances registering one new adapter
                    # must see each other's row; other rows are this instance's own, written before the wait
                    with write_transaction(engine, lock=bool(batch.adapters)) as conn:
                        issued: dict[str, Receipt] = {}
                        head = write_batch(conn, batch, self.instance_id, log_key=self.log_key, receipts=issued)
                        committing = True  # leaving the block sends COMMIT
                    if receipts is not None:
                        receipts.update(issued)
                    return head
                except (sa_exc.IntegrityError, sa_exc.InternalError, sa_exc.DataError) as exc:
                    if op is not None and op.expired:
                        raise  # the watchdog cut the connection: not a refusal of the batch
                    # a guard, a constraint or a value the column cannot hold refused a row: retrying the same
                    # batch cannot help (unlike an outage), and nothing of it is on record
                    raise AuditIntegrityError(
                        f"the audit store at {display_url(self.url)} refused the batch, nothing was written: "
                        f"{str(exc.orig).strip()}"
                    ) from exc
        except AuditUnavailableError as exc:
            # False: it failed before COMMIT was sent, so nothing of the batch can be on record
            exc.maybe_committed = committing  # type: ignore[attr-defined]
            raise

    # -- instance and lease -----------------------------------------------------------------

    @property
    def instance_id(self) -> str | None:
        return None if self.instance is None else self.instance.instance_id

    def register(self, record: InstanceRecord) -> InstanceRecord:
        """Register this engine as an instance (its row, its instance_registered event, its first lease);
        from then on every write carries its id. Returns the record as registered."""
        if self.instance is not None:
            raise AuditIntegrityError(
                f"this store already registered instance {self.instance.instance_id}; one engine, one instance"
            )
        with self._operation(self.timeout), write_transaction(self.engine) as conn:
            registered, event = instances.register(conn, record)
            append_events(conn, [event], record.instance_id)
        self.instance = registered
        return registered

    def renew_lease(self) -> float:
        """Extend this instance's lease by its lease_seconds (database clock); returns the new expiry (unix seconds).
        InstanceLeaseLostError when another instance has recovered it; AuditUnavailableError when the store does not answer."""
        if self.instance is None:
            raise AuditIntegrityError("renew_lease: this store registered no instance; call register() first")
        with self._operation(self.timeout), write_transaction(self.engine) as conn:
            return instances.renew(conn, self.instance.instance_id, self.instance.lease_seconds)

    def release_lease(self) -> None:
        """End this instance's lease now (at a clean stop); it writes nothing afterwards."""
        if self.instance is None:
            return
        with self._operation(self.timeout), write_transaction(self.engine) as conn:
            left = _unfinished(conn, REQUESTS.c.instance_id == self.instance_id)
            append_events(conn, instances.release(conn, self.instance_id, unfinished=bool(left)), self.instance_id)

    def recover_expired(self, *, resume: bool = False, at_start: bool = True) -> Recovery:
        """Claim the instances whose lease expired and put their unfinished requests on record as interrupted
        (see the module function; resume says in the record whether the claimer re-runs them). at_start: also the
        requests no instance owns (a log from before revision 0007); later sweeps first look without the writers'
        lock, and take it only when some lease has expired."""
        if not at_start:
            with self._reading(self.timeout) as conn:
                if not instances.claimable(conn, self.instance_id):
                    return Recovery(instances=[], requests=[])
        with self._operation(self._at_least(SCAN_TIMEOUT_S)), write_transaction(self.engine) as conn:
            return recover_expired(conn, self.instance_id, at=time.time(), resume=resume, unowned=at_start)

    def lease_states(self) -> list[LeaseState]:
        """Every instance registered in this database, with its lease."""
        with self._reading(self.timeout) as conn:
            return instances.lease_states(conn)

    # -- reading ---------------------------------------------------------------------------

    def head(self) -> Checkpoint:
        """The last event's seq, hash and time (seq 0 and the genesis hash for an empty log)."""
        with self._reading(self.timeout) as conn:
            return _head(conn)

    def existing_request_ids(self, ids: Iterable[str]) -> set[str]:
        """The ids among ids that are already in the `requests` table."""
        with self._reading(self.timeout) as conn:
            return _existing(conn, REQUESTS.c.request_id, sorted(set(ids)))

    def unfinished_requests(self, instance_id: str | None = None) -> list[RequestRecord]:
        """Requests on record with no terminal event (finished, aborted, failed or interrupted), oldest first:
        every instance's, or instance_id's alone."""
        owners = true() if instance_id is None else REQUESTS.c.instance_id == instance_id
        with self._reading(self._at_least(SCAN_TIMEOUT_S)) as conn:
            return _unfinished(conn, owners)

    def admitted_payloads(self, request_ids: Iterable[str]) -> dict[str, dict]:
        """The request_admitted event payload of each id (the binding, and the prompt token ids when prompts are kept)."""
        ids = list(request_ids)
        found: dict[str, dict] = {}
        with self._reading(self._at_least(SCAN_TIMEOUT_S)) as conn:
            for chunk in _chunks(ids):
                query = select(EVENTS.c.request_id, EVENTS.c.payload).where(
                    EVENTS.c.kind == EventKind.REQUEST_ADMITTED, EVENTS.c.request_id.in_(list(chunk))
                )
                for request_id, payload in conn.execute(query):
                    found[request_id] = payload if isinstance(payload, dict) else json.loads(payload)
        return found

    def first_break(self, *, batch_size: int = 1000) -> ChainBreak | None:
        """Recompute the whole event hash chain, streaming; the first break, or None if it verifies (no deadline)."""
        query = select(EVENTS).order_by(EVENTS.c.seq)
        with self._reading(None) as conn:
            rows = conn.execution_options(yield_per=batch_size).execute(query)
            return first_break(rows)
