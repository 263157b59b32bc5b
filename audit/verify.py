"""Audit log verification: the hash chain, sequence gaps, and every row of every table against the event that vouches for it.

One ordered pass over `events` (one chain, whatever the number of engine instances that wrote it):
each request_admitted event is joined to its `requests` row (whose instance_id must be the event's),
each adapter_registered and instance_registered event looks up its `adapters` or `instances` row, and the completions of finished and
aborted requests come from a second cursor read alongside (merged by sequence number), their
digest computed as they stream. Then a few queries find rows that no event vouches for. One
event and one completion row are held at a time, so memory stays flat whatever the log's size
(a request with n completions included). Rows are read untyped and decoded column by column
(audit/raw_rows.py): a malformed value is a problem reported at its row, never an exception.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
from sqlalchemy import Connection, Dialect, Row, and_, func, not_, select

from loraledger.audit import rows
from loraledger.audit.queries import A, C, E, I, R, stream
from loraledger.audit.raw_rows import RawTable, describe, unix_times
from loraledger.audit.records import Problem, VerifyResult
from loraledger.audit.row_stream import RowStream
from loraledger.audit.schema_objects import check_schema_objects
from loraledger.errors import ConfigError
from loraledger.store import instances
from loraledger.store.canonical import canonical_json, digest
from loraledger.store.hashchain import GENESIS_HASH, EventFields, event_hash
from loraledger.store.instances import LEASES as L
from loraledger.store.records import Checkpoint, CompletionRecord, EventKind
from loraledger.store.registration import is_registered, registration_key

_R, _C = "r_", "c_"
# Events that end a request with completions on record; the engine puts their digest in the payload.
_ENDING_KINDS = (EventKind.REQUEST_FINISHED, EventKind.REQUEST_ABORTED)
_JOINED_KINDS = (EventKind.REQUEST_ADMITTED, *_ENDING_KINDS)
_UPGRADE_HINT = "a log written before revision 0004 needs `loraledger db upgrade`"


def verify_log(
    conn: Connection, checkpoint: Checkpoint | None = None, *, on_event: Callable[[], None] | None = None
) -> VerifyResult:
    """Check the whole log; problems are reported at the first event sequence number they concern.

    checkpoint: a head from an earlier export that the log must still contain unchanged.
    on_event: called once per event checked (progress display).
    """
    tables = _Tables(conn.dialect)
    found = _Problems()
    walk = _Walk(conn, tables, found, checkpoint)
    completions = stream(conn, _ending_completions(tables))
    try:
        walk.completions = RowStream(completions)
        for row in stream(conn, _events(tables)):
            walk.event(row)
            if on_event is not None:
                on_event()
    finally:
        completions.close()
    if checkpoint is not None:
        last = walk.head.sequence if walk.head is not None else 0
        if last < checkpoint.sequence:
            found.add(
                last + 1,
                f"the log ends at seq {last} but the checkpoint is at seq {checkpoint.sequence}: "
                f"events {last + 1} to {checkpoint.sequence} were removed",
                table="events",
                key={"seq": last + 1},
            )
    _check_unbound(conn, found)
    _check_unregistered(conn, tables, found)
    _check_unregistered_instances(conn, found)
    _check_unclaimed_recoveries(conn, walk.claims, found)
    _check_unvouched_completions(conn, found)
    _check_completion_adapters(conn, found)
    check_schema_objects(conn, found.add)  # the views are as the migrations made them
    n_requests = conn.execute(select(func.count()).select_from(R)).scalar_one()
    n_completions = conn.execute(select(func.count()).select_from(C)).scalar_one()
    return VerifyResult(
        ok=found.count == 0,
        head=walk.head,
        events=walk.events,
        requests=int(n_requests),
        completions=int(n_completions),
        problems=found.sorted(),
        problem_count=found.count,
    )


class _Problems:
    """The problems found, at most MAX_PROBLEMS kept (the lowest sequence numbers), all counted."""

    def __init__(self) -> None:
        self.count = 0
        self._kept: list[Problem] = []

    def add(
        self,
        sequence: Any,
        message: str,
        request_id: Any = None,
        *,
        table: str | None = None,
        key: dict[str, Any] | None = None,
    ) -> None:
        self.count += 1
        sequence = sequence if _is_int(sequence) else None  # a malformed seq is named in the message and key
        request_id = request_id if isinstance(request_id, str) else None
        self._kept.append(Problem(sequence=sequence, message=message, request_id=request_id, table=table, key=key))
        if len(self._kept) > 2 * VerifyResult.MAX_PROBLEMS:
            self._kept = self.sorted()

    def sorted(self) -> list[Problem]:
        key = lambda p: (p.sequence is None, p.sequence or 0)  # noqa: E731
        return sorted(self._kept, key=key)[: VerifyResult.MAX_PROBLEMS]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Tables:
    """The four audit tables, read untyped and decoded column by column."""

    def __init__(self, dialect: Dialect):
        self.adapters = RawTable(A, dialect)
        self.requests = RawTable(R, dialect)
        self.completions = RawTable(C, dialect)
        self.events = RawTable(E, dialect)
        self.instances = RawTable(I, dialect)


def _events(t: _Tables) -> Any:
    """Every event in seq order; admitted, finished and aborted ones with their `requests` row (prefixed r_)."""
    e, r = t.events.untyped, t.requests.untyped
    joined = and_(r.c.request_id == e.c.request_id, e.c.kind.in_(_JOINED_KINDS))
    return select(*t.events.columns(), *t.requests.columns(_R)).select_from(e.outerjoin(r, joined)).order_by(e.c.seq)


def _ending_completions(t: _Tables) -> Any:
    """The completions of every finished or aborted request, in the order of its ending event's seq."""
    e, c = t.events.untyped, t.completions.untyped
    return (
        select(e.c.seq.label("end_seq"), *t.completions.columns(_C))
        .select_from(e.join(c, c.c.request_id == e.c.request_id))
        .where(e.c.kind.in_(_ENDING_KINDS))
        .order_by(e.c.seq, c.c.completion_index)
    )


def _rows_of_event(completions: RowStream, seq: int) -> Iterator[Row[Any]]:
    """The completion rows of the event at seq; rows of an earlier event (one whose seq the walk could not
    place) are skipped."""
    for row in completions.take_while(lambda r: _is_number(r.end_seq) and r.end_seq <= seq):
        if row.end_seq == seq:
            yield row


class _ListDigest:
    """sha256 of the canonical JSON of a list, fed one item at a time (canonical_json writes "[a,b]")."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256(b"[")
        self._first = True

    def add(self, item: Any) -> None:
        if not self._first:
            self._sha.update(b",")
        self._first = False
        self._sha.update(canonical_json(item))

    def hexdigest(self) -> str:
        done = self._sha.copy()
        done.update(b"]")
        return done.hexdigest()


def _safe_digest(value: Any) -> str | None:
    try:
        return digest(value)
    except (TypeError, ValueError):  # e.g. NaN read back from a JSON column: no canonical form
        return None


def _differences(expected: Mapping[str, Any], on_record: Mapping[str, Any]) -> list[str]:
    return sorted(k for k in set(expected) | set(on_record) if expected.get(k) != on_record.get(k))


class _Walk:
    """The ordered pass over the events: chain, gaps, checkpoint, and each event's rows."""

    def __init__(self, conn: Connection, tables: _Tables, found: _Problems, checkpoint: Checkpoint | None):
        self.conn, self.t, self.found, self.checkpoint = conn, tables, found, checkpoint
        self.completions: RowStream | None = None
        self.expected, self.prev = 1, GENESIS_HASH
        self.head: Checkpoint | None = None
        self.events = 0
        # (claimer, instance) of every claim engine_recovered events put on record: one pair per recovered instance
        self.claims: set[tuple[str, str]] = set()

    def event(self, row: Row[Any]) -> None:
        self.events += 1
        m = row._mapping
        ev, bad = self.t.events.decode(m)
        seq = ev.get("seq")
        if seq is None:  # not an integer: the row has no place in the chain
            raw = m["seq"]
            self.found.add(None, f"`events` row with seq {raw!r} cannot be placed in the chain: {describe(bad)}",
                           table="events", key={"seq": raw if isinstance(raw, (str, int, float)) else repr(raw)})  # fmt: skip
            return
        found, key = self.found, {"seq": seq}
        if seq != self.expected:
            missing = f"{self.expected}" if seq == self.expected + 1 else f"{self.expected} to {seq - 1}"
            found.add(self.expected, f"event seq {missing} is missing (the next event on record is seq {seq}): rows were deleted",
                      table="events", key={"seq": self.expected})  # fmt: skip
        elif "prev_hash" in ev and ev["prev_hash"] != self.prev:
            found.add(seq, f"prev_hash does not match the hash of event {seq - 1}: event {seq - 1} or {seq} was rewritten",
                      table="events", key=key)  # fmt: skip
        if bad:
            found.add(
                seq,
                f"`events` row seq={seq} cannot be verified: {describe(bad)}",
                ev.get("request_id"),
                table="events",
                key=key,
            )
        else:
            self._check_hash(seq, ev)
        if self.checkpoint is not None and seq == self.checkpoint.sequence and ev.get("hash") != self.checkpoint.hash:
            found.add(seq, f"event {seq}'s hash differs from the checkpoint's: the log up to the checkpoint was rewritten",
                      table="events", key=key)  # fmt: skip
        if not bad:
            kind = ev["kind"]
            if kind == EventKind.REQUEST_ADMITTED:
                self._check_admitted(seq, ev, m)
            elif kind in _ENDING_KINDS:
                self._check_ending(seq, ev, m)
            elif kind == EventKind.ADAPTER_REGISTERED:
                self._check_registered(seq, ev)
            elif kind == EventKind.INSTANCE_REGISTERED:
                self._check_instance(seq, ev)
            elif kind == EventKind.ENGINE_RECOVERED:
                self._check_recovered(seq, ev)
        self.expected, self.prev = seq + 1, ev.get("hash")
        if isinstance(ev.get("hash"), str) and "at" in ev:
            self.head = Checkpoint(sequence=seq, hash=ev["hash"], at=ev["at"].timestamp())

    def _check_hash(self, seq: int, ev: dict[str, Any]) -> None:
        fields = EventFields(
            seq, ev["at"], ev["kind"], ev["request_id"], ev["payload"], ev["dedup_key"], ev.get("instance_id")
        )
        try:
            intact = event_hash(ev["prev_hash"], fields) == ev["hash"]
        except (
            TypeError,
            ValueError,
            UnicodeEncodeError,
        ):  # a payload with no canonical form cannot be what was hashed
            intact = False
        if not intact:
            self.found.add(seq, f"the hash of event {seq} ({ev['kind']}) does not match its contents: the row was altered",
                           ev["request_id"], table="events", key={"seq": seq})  # fmt: skip

    # -- requests ---------------------------------------------------------------------------

    def _check_admitted(self, seq: int, ev: dict[str, Any], m: Mapping[str, Any]) -> None:
        found, rid, payload = self.found, ev["request_id"], ev["payload"]
        binding = payload.get("binding") if isinstance(payload, dict) else None
        if not isinstance(binding, dict):
            found.add(
                seq, f"request_admitted event for {rid!r} carries no binding", rid, table="events", key={"seq": seq}
            )
            return
        if _safe_digest(binding) != payload.get("binding_sha256"):
            found.add(seq, f"the binding in the request_admitted event for {rid!r} does not match its binding_sha256", rid,
                      table="events", key={"seq": seq})  # fmt: skip
        if binding.get("request_id") != rid:
            found.add(seq, f"the request_admitted event for {rid!r} carries the binding of {binding.get('request_id')!r}", rid,
                      table="events", key={"seq": seq})  # fmt: skip
        key = {"request_id": rid}
        if m[_R + "request_id"] is None:
            found.add(
                seq,
                f"request {rid!r} was admitted but its binding row in `requests` is missing",
                rid,
                table="requests",
                key=key,
            )
            return
        values, bad = self.t.requests.decode(m, _R)
        if bad:
            found.add(
                seq, f"the `requests` row of {rid!r} cannot be read: {describe(bad)}", rid, table="requests", key=key
            )
            return
        try:
            expected = rows.binding_builtins(binding)
        except (TypeError, ValueError, OverflowError):
            expected = binding
        # the instance that admitted the request is the event's (hashed), not the binding's
        expected = {**expected, "instance_id": ev.get("instance_id")}
        differ = _differences(expected, unix_times(values))
        if differ:
            found.add(seq, f"the `requests` row of {rid!r} differs from its admitted binding in: {', '.join(differ)}", rid,
                      table="requests", key=key)  # fmt: skip

    # -- completions ------------------------------------------------------------------------

    def _check_ending(self, seq: int, ev: dict[str, Any], m: Mapping[str, Any]) -> None:
        """A finished (or aborted) request: its completions name its adapter and match the event's digest.

        request_finished must carry completions_sha256 and num_completions; request_aborted is checked
        when it carries them (an abort before any output has nothing to vouch for, and then no rows).
        """
        found, rid, kind = self.found, ev["request_id"], ev["kind"]
        payload = ev["payload"] if isinstance(ev["payload"], dict) else {}
        bound_row = m[_R + "request_id"] is not None
        bound = m[_R + "adapter_fingerprint"]
        if not bound_row:
            found.add(seq, f"request {rid!r} ended ({kind}) but its binding row in `requests` is missing", rid,
                      table="requests", key={"request_id": rid})  # fmt: skip
        count, readable, wrong_adapter = 0, True, False
        sha = _ListDigest()
        assert self.completions is not None
        for row in _rows_of_event(self.completions, seq):
            count += 1
            values, bad = self.t.completions.decode(row._mapping, _C)
            index = values.get("completion_index", row._mapping[_C + "completion_index"])
            key = {"request_id": rid, "completion_index": index}
            record = _completion(values) if not bad else describe(bad)
            if isinstance(record, str):
                readable = False
                found.add(seq, f"the `completions` row ({rid!r}, {index!r}) cannot be read: {record}", rid,
                          table="completions", key=key)  # fmt: skip
                continue
            if bound_row and not wrong_adapter and record.adapter_fingerprint != bound:
                wrong_adapter = True
                named = record.adapter_fingerprint
                found.add(seq, f"completion {index} of {rid!r} names adapter {named} but the request is bound to {bound}",
                          rid, table="completions", key=key)  # fmt: skip
            sha.add(rows.completion_builtins(record))
        key = {"request_id": rid}
        if "completions_sha256" not in payload:
            if kind == EventKind.REQUEST_FINISHED:
                found.add(seq, f"the request_finished event of {rid!r} carries no completions_sha256", rid,
                          table="events", key={"seq": seq})  # fmt: skip
            elif count:
                found.add(seq, f"request {rid!r} was aborted before any output, yet {count} `completions` rows are on record for it",
                          rid, table="completions", key=key)  # fmt: skip
            return
        expected_n = payload.get("num_completions")
        if expected_n is not None and expected_n != count:
            found.add(seq, f"request {rid!r} ended ({kind}) with {expected_n} completions but {count} are on record", rid,
                      table="completions", key=key)  # fmt: skip
            return
        if readable and sha.hexdigest() != payload["completions_sha256"]:
            found.add(seq, f"the completions of {rid!r} on record do not match the {kind} event's completions_sha256", rid,
                      table="completions", key=key)  # fmt: skip

    # -- adapters ---------------------------------------------------------------------------

    def _check_registered(self, seq: int, ev: dict[str, Any]) -> None:
        found, payload = self.found, ev["payload"]
        adapter = payload.get("adapter") if isinstance(payload, dict) else None
        if not isinstance(adapter, dict) or not isinstance(adapter.get("fingerprint"), str):
            found.add(seq, "an adapter_registered event carries no adapter row", table="events", key={"seq": seq})
            return
        fp = adapter["fingerprint"]
        if ev["dedup_key"] != registration_key(fp):
            found.add(seq, f"the adapter_registered event of {fp} has dedup_key {ev['dedup_key']!r}, not {registration_key(fp)!r}",
                      table="events", key={"seq": seq})  # fmt: skip
        if "adapter_sha256" in payload and _safe_digest(adapter) != payload["adapter_sha256"]:
            found.add(seq, f"the adapter in the adapter_registered event of {fp} does not match its adapter_sha256",
                      table="events", key={"seq": seq})  # fmt: skip
        self._check_registered_row(
            seq, self.t.adapters, "fingerprint", adapter, "adapter", EventKind.ADAPTER_REGISTERED
        )

    # -- instances --------------------------------------------------------------------------

    def _check_instance(self, seq: int, ev: dict[str, Any]) -> None:
        found, payload = self.found, ev["payload"]
        instance = payload.get("instance") if isinstance(payload, dict) else None
        if not isinstance(instance, dict) or not isinstance(instance.get("instance_id"), str):
            found.add(seq, "an instance_registered event carries no instance row", table="events", key={"seq": seq})
            return
        iid = instance["instance_id"]
        if ev["dedup_key"] != instances.registration_key(iid) or ev.get("instance_id") != iid:
            found.add(seq, f"the instance_registered event of {iid} has dedup_key {ev['dedup_key']!r} and instance_id "
                      f"{ev.get('instance_id')!r}: it was not written by that instance", table="events", key={"seq": seq})  # fmt: skip
        if _safe_digest(instance) != payload.get("instance_sha256"):
            found.add(seq, f"the instance in the instance_registered event of {iid} does not match its instance_sha256",
                      table="events", key={"seq": seq})  # fmt: skip
        self._check_registered_row(
            seq, self.t.instances, "instance_id", instance, "instance", EventKind.INSTANCE_REGISTERED
        )

    def _check_recovered(self, seq: int, ev: dict[str, Any]) -> None:
        """The instances an engine_recovered event claims (revision 0007 on): each lease names its writer as the
        instance that recovered it (`audit instances` shows it; the lease table changes in place, the claim is here)."""
        claimed = ev["payload"].get("instances") if isinstance(ev["payload"], dict) else None
        if not isinstance(claimed, list):
            return
        claimer = ev.get("instance_id") or instances.TOOL_CLAIMER
        ids = [iid for iid in claimed if isinstance(iid, str)]
        self.claims.update((claimer, iid) for iid in ids)
        query = select(L.c.instance_id, L.c.recovered_by).where(L.c.instance_id.in_(ids))
        leases = {row.instance_id: row.recovered_by for row in self.conn.execute(query)} if ids else {}
        for iid in ids:
            if leases.get(iid) != claimer:
                self.found.add(seq, f"instance {iid} was recovered by {claimer} (engine_recovered event {seq}), but its lease in "
                               f"`instance_leases` names {leases.get(iid)!r}", table="instance_leases", key={"instance_id": iid})  # fmt: skip

    def _check_registered_row(
        self, seq: int, t: RawTable, column: str, recorded: dict[str, Any], noun: str, kind: str
    ) -> None:
        """The row a registration event (adapter or instance) carries a copy of: present, readable, and equal to it."""
        found, value = self.found, recorded[column]
        key = {column: value}
        row = self.conn.execute(select(*t.columns()).where(t.c[column] == value)).first()
        if row is None:
            found.add(
                seq,
                f"{noun} {value} was registered (event {seq}) but its row in `{t.name}` is missing",
                table=t.name,
                key=key,
            )
            return
        values, bad = t.decode(row._mapping)
        if bad:
            found.add(seq, f"the `{t.name}` row of {value} cannot be read: {describe(bad)}", table=t.name, key=key)
            return
        differ = _differences(recorded, unix_times(values))
        if differ:
            found.add(seq, f"the `{t.name}` row of {value} differs from its {kind} event (seq {seq}) in: {', '.join(differ)}",
                      table=t.name, key=key)  # fmt: skip


def _completion(values: dict[str, Any]) -> CompletionRecord | str:
    """A decoded completions row as the record its digest is taken over, or why it is not one."""
    fields = unix_times(values)
    fields["index"] = fields.pop("completion_index")
    try:
        return msgspec.convert(fields, CompletionRecord)
    except msgspec.ValidationError as exc:
        return f"it does not hold a completion ({exc})"


# -- rows no event vouches for ---------------------------------------------------------------


def _first_seq(request_id: Any) -> Any:
    return select(func.min(E.c.seq)).where(E.c.request_id == request_id).correlate_except(E).scalar_subquery()


def _check_unbound(conn: Connection, found: _Problems) -> None:
    """Requests on record that no request_admitted event vouches for."""
    admitted = select(E.c.seq).where(E.c.request_id == R.c.request_id, E.c.kind == EventKind.REQUEST_ADMITTED).exists()
    total = conn.execute(select(func.count()).select_from(R).where(not_(admitted))).scalar_one()
    if not total:
        return
    stmt = (
        select(R.c.request_id, _first_seq(R.c.request_id).label("seq")).where(not_(admitted)).order_by(R.c.request_id)
    )
    for row in stream(conn, stmt.limit(VerifyResult.MAX_PROBLEMS)):
        found.add(row.seq, f"request {row.request_id!r} is in `requests` but has no request_admitted event", row.request_id,
                  table="requests", key={"request_id": row.request_id})  # fmt: skip
    found.count += max(0, total - VerifyResult.MAX_PROBLEMS)


def _check_unregistered(conn: Connection, t: _Tables, found: _Problems) -> None:
    """`adapters` rows that no adapter_registered event vouches for."""
    registered = is_registered(A, E)
    total = conn.execute(select(func.count()).select_from(A).where(not_(registered))).scalar_one()
    if not total:
        return
    stmt = select(A.c.fingerprint).where(not_(registered)).order_by(A.c.fingerprint).limit(VerifyResult.MAX_PROBLEMS)
    for fp in conn.execute(stmt).scalars():
        found.add(None, f"adapter {fp} is in `adapters` but no adapter_registered event vouches for it ({_UPGRADE_HINT})",
                  table="adapters", key={"fingerprint": fp})  # fmt: skip
    found.count += max(0, total - VerifyResult.MAX_PROBLEMS)


def _check_unregistered_instances(conn: Connection, found: _Problems) -> None:
    """`instances` rows that no instance_registered event vouches for."""
    query = instances.unregistered(I, E)
    total = conn.execute(select(func.count()).select_from(query.subquery())).scalar_one()
    if not total:
        return
    for iid in conn.execute(query.limit(VerifyResult.MAX_PROBLEMS)).scalars():
        found.add(None, f"instance {iid} is in `instances` but no instance_registered event vouches for it",
                  table="instances", key={"instance_id": iid})  # fmt: skip
    found.count += max(0, total - VerifyResult.MAX_PROBLEMS)


def _check_unclaimed_recoveries(conn: Connection, claims: set[tuple[str, str]], found: _Problems) -> None:
    """Leases that name an instance (or a tool) as their recoverer when no engine_recovered event of it claims them."""
    for iid, claimer in stream(conn, instances.recovered_leases()):
        if (claimer, iid) not in claims:
            found.add(None, f"the lease of instance {iid} in `instance_leases` names {claimer} as the one that recovered it, "
                      "but no engine_recovered event of it claims that instance", table="instance_leases", key={"instance_id": iid})  # fmt: skip


def _check_unvouched_completions(conn: Connection, found: _Problems) -> None:
    """Completions of requests with no request_finished or request_aborted event: nothing vouches for them."""
    ended = select(E.c.seq).where(E.c.request_id == C.c.request_id, E.c.kind.in_(_ENDING_KINDS)).exists()
    total = conn.execute(select(func.count()).select_from(C).where(not_(ended))).scalar_one()
    if not total:
        return
    stmt = (
        select(C.c.request_id, C.c.completion_index, _first_seq(C.c.request_id).label("seq"))
        .where(not_(ended))
        .order_by(C.c.request_id, C.c.completion_index)
        .limit(VerifyResult.MAX_PROBLEMS)
    )
    for row in stream(conn, stmt):
        found.add(
            row.seq,
            f"the `completions` row ({row.request_id!r}, {row.completion_index!r}) has no request_finished or "
            "request_aborted event vouching for it",
            row.request_id,
            table="completions",
            key={"request_id": row.request_id, "completion_index": row.completion_index},
        )
    found.count += max(0, total - VerifyResult.MAX_PROBLEMS)


def _check_completion_adapters(conn: Connection, found: _Problems) -> None:
    """Completions naming an adapter that is not in `adapters`."""
    orphans = (
        select(C.c.request_id, C.c.completion_index, C.c.adapter_fingerprint)
        .select_from(C.outerjoin(A, A.c.fingerprint == C.c.adapter_fingerprint))
        .where(C.c.adapter_fingerprint.is_not(None), A.c.fingerprint.is_(None))
        .limit(VerifyResult.MAX_PROBLEMS)
    )
    for row in stream(conn, orphans):
        found.add(None, f"a completion of {row.request_id!r} names adapter {row.adapter_fingerprint}, which is not in `adapters`",
                  row.request_id, table="completions",
                  key={"request_id": row.request_id, "completion_index": row.completion_index})  # fmt: skip


# -- checkpoint files ----------------------------------------------------------------------


def write_checkpoint(path: Path | str, checkpoint: Checkpoint) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(checkpoint), indent=2) + b"\n")


def read_checkpoint(path: Path | str) -> Checkpoint:
    """A checkpoint file, or a report's manifest.json (its chain_head is the checkpoint)."""
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read checkpoint file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"checkpoint file {path} is not JSON: {exc.msg}") from None
    if isinstance(data, dict) and "chain_head" in data:
        data = data["chain_head"]
        if data is None:
            raise ConfigError(f"{path} is a report of an empty log: it has no chain head to check against")
    try:
        return msgspec.convert(data, Checkpoint)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path} is not a checkpoint ({{'sequence', 'hash', 'at'}}): {exc}") from None
