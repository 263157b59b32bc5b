"""What each event vouches for, checked against the rows on record: bindings, completions, registrations, claims."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
from sqlalchemy import Connection, Dialect, Row, and_, select

from loraledger.audit import typed_rows as rows
from loraledger.audit.problems import Problems, is_number
from loraledger.audit.queries import A, C, E, I, R
from loraledger.audit.raw_rows import RawTable, describe, unix_times
from loraledger.audit.row_stream import RowStream
from loraledger.digests import CompletionsDigest, binding_digest, registration_digest
from loraledger.store import instances
from loraledger.store.instances import LEASES as L
from loraledger.store.records import CompletionRecord, EventKind
from loraledger.store.registration import registration_key

_R, _C = "r_", "c_"
# Events that end a request with completions on record; the engine puts their digest in the payload.
ENDING_KINDS = (EventKind.REQUEST_FINISHED, EventKind.REQUEST_ABORTED)
JOINED_KINDS = (EventKind.REQUEST_ADMITTED, *ENDING_KINDS)


class Tables:
    """The audit tables, read untyped and decoded column by column."""

    def __init__(self, dialect: Dialect):
        self.adapters = RawTable(A, dialect)
        self.requests = RawTable(R, dialect)
        self.completions = RawTable(C, dialect)
        self.events = RawTable(E, dialect)
        self.instances = RawTable(I, dialect)


def events_query(t: Tables) -> Any:
    """Every event in seq order; admitted, finished and aborted ones with their `requests` row (prefixed r_)."""
    e, r = t.events.untyped, t.requests.untyped
    joined = and_(r.c.request_id == e.c.request_id, e.c.kind.in_(JOINED_KINDS))
    return select(*t.events.columns(), *t.requests.columns(_R)).select_from(e.outerjoin(r, joined)).order_by(e.c.seq)


def ending_completions_query(t: Tables) -> Any:
    """The completions of every finished or aborted request, in the order of its ending event's seq."""
    e, c = t.events.untyped, t.completions.untyped
    return (
        select(e.c.seq.label("end_seq"), *t.completions.columns(_C))
        .select_from(e.join(c, c.c.request_id == e.c.request_id))
        .where(e.c.kind.in_(ENDING_KINDS))
        .order_by(e.c.seq, c.c.completion_index)
    )


def _rows_of_event(completions: RowStream, seq: int) -> Iterator[Row[Any]]:
    """The completion rows of the event at seq; rows of an earlier event (one whose seq the walk could not
    place) are skipped."""
    for row in completions.take_while(lambda r: is_number(r.end_seq) and r.end_seq <= seq):
        if row.end_seq == seq:
            yield row


def _safe_digest(compute: Callable[[Any], str], value: Any) -> str | None:
    try:
        return compute(value)
    except (TypeError, ValueError):  # e.g. NaN read back from a JSON column: no canonical form
        return None


def _differences(expected: Mapping[str, Any], on_record: Mapping[str, Any]) -> list[str]:
    return sorted(k for k in set(expected) | set(on_record) if expected.get(k) != on_record.get(k))


class EventRows:
    """Each event's rows, checked as the walk reaches the event: a binding against its `requests` row, an ending
    against its `completions` rows (read alongside from a second cursor, merged by sequence number, their digest
    taken as they stream), a registration against its `adapters` or `instances` row, a recovery against leases."""

    def __init__(self, conn: Connection, tables: Tables, found: Problems, completions: RowStream):
        self.conn, self.t, self.found, self.completions = conn, tables, found, completions
        # (claimer, instance) of every claim engine_recovered events put on record: one pair per recovered instance
        self.claims: set[tuple[str, str]] = set()

    def check(self, seq: int, ev: dict[str, Any], m: Mapping[str, Any]) -> None:
        """The rows event ev (decoded, its hash checked) vouches for; m: its row, joined to its `requests` row."""
        kind = ev["kind"]
        if kind == EventKind.REQUEST_ADMITTED:
            self._check_admitted(seq, ev, m)
        elif kind in ENDING_KINDS:
            self._check_ending(seq, ev, m)
        elif kind == EventKind.ADAPTER_REGISTERED:
            self._check_registered(seq, ev)
        elif kind == EventKind.INSTANCE_REGISTERED:
            self._check_instance(seq, ev)
        elif kind == EventKind.ENGINE_RECOVERED:
            self._check_recovered(seq, ev)

    # -- requests ---------------------------------------------------------------------------

    def _check_admitted(self, seq: int, ev: dict[str, Any], m: Mapping[str, Any]) -> None:
        found, rid, payload = self.found, ev["request_id"], ev["payload"]
        binding = payload.get("binding") if isinstance(payload, dict) else None
        if not isinstance(binding, dict):
            found.add(
                seq, f"request_admitted event for {rid!r} carries no binding", rid, table="events", key={"seq": seq}
            )
            return
        if _safe_digest(binding_digest, binding) != payload.get("binding_sha256"):
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
        sha = CompletionsDigest()
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
            sha.add(record)
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
        if "adapter_sha256" in payload and _safe_digest(registration_digest, adapter) != payload["adapter_sha256"]:
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
        if _safe_digest(registration_digest, instance) != payload.get("instance_sha256"):
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
