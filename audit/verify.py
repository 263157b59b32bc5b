"""Audit log verification: the hash chain, sequence gaps, bindings, completions, and checkpoints.

One ordered pass over `events`, joined to the binding and completions of each admitted or
finished request, so the whole log is checked while only one event is held in memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
from sqlalchemy import Connection, Row, and_, func, not_, select

from loraledger.audit import rows
from loraledger.audit.queries import A, C, E, R, stream
from loraledger.audit.records import Problem, VerifyResult
from loraledger.errors import ConfigError
from loraledger.store.canonical import digest
from loraledger.store.hashchain import GENESIS_HASH, EventFields, event_hash
from loraledger.store.records import Checkpoint, EventKind

_R, _C = "r_", "c_"
# Events that end a request with completions on record; the engine puts their digest in the payload.
_ENDING_KINDS = (EventKind.REQUEST_FINISHED, EventKind.REQUEST_ABORTED)
_CHECKED_KINDS = (EventKind.REQUEST_ADMITTED, *_ENDING_KINDS)


def verify_log(
    conn: Connection, checkpoint: Checkpoint | None = None, *, on_event: Callable[[], None] | None = None
) -> VerifyResult:
    """Check the whole log; problems are reported at the first event sequence number they concern.

    checkpoint: a head from an earlier export that the log must still contain unchanged.
    on_event: called once per event checked (progress display).
    """
    found = _Problems()
    head: Checkpoint | None = None
    expected, prev = 1, GENESIS_HASH
    events = 0
    for event, completions in _event_groups(conn):
        events += 1
        if on_event is not None:
            on_event()
        seq = event.seq
        if seq != expected:
            missing = f"{expected}" if seq == expected + 1 else f"{expected} to {seq - 1}"
            found.add(expected, f"event seq {missing} is missing (the next event on record is seq {seq}): rows were deleted")
        elif event.prev_hash != prev:
            found.add(seq, f"prev_hash does not match the hash of event {seq - 1}: event {seq - 1} or {seq} was rewritten")
        fields = EventFields(seq, event.at, event.kind, event.request_id, event.payload, event.dedup_key)
        if event_hash(event.prev_hash, fields) != event.hash:
            found.add(seq, f"the hash of event {seq} ({event.kind}) does not match its contents: the row was altered")
        if checkpoint is not None and seq == checkpoint.sequence and event.hash != checkpoint.hash:
            found.add(seq, f"event {seq}'s hash differs from the checkpoint's: the log up to the checkpoint was rewritten")
        if event.kind == EventKind.REQUEST_ADMITTED:
            _check_admitted(event, found)
        elif event.kind in _ENDING_KINDS:
            _check_ending(event, completions, found)
        expected, prev = seq + 1, event.hash
        head = Checkpoint(sequence=seq, hash=event.hash, at=event.at.timestamp())
    if checkpoint is not None:
        last = head.sequence if head is not None else 0
        if last < checkpoint.sequence:
            found.add(
                last + 1,
                f"the log ends at seq {last} but the checkpoint is at seq {checkpoint.sequence}: "
                f"events {last + 1} to {checkpoint.sequence} were removed",
            )
    _check_unbound(conn, found)
    _check_completion_adapters(conn, found)
    n_requests = conn.execute(select(func.count()).select_from(R)).scalar_one()
    n_completions = conn.execute(select(func.count()).select_from(C)).scalar_one()
    return VerifyResult(
        ok=found.count == 0,
        head=head,
        events=events,
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

    def add(self, sequence: int | None, message: str, request_id: str | None = None) -> None:
        self.count += 1
        self._kept.append(Problem(sequence=sequence, message=message, request_id=request_id))
        if len(self._kept) > 2 * VerifyResult.MAX_PROBLEMS:
            self._kept = self.sorted()

    def sorted(self) -> list[Problem]:
        key = lambda p: (p.sequence is None, p.sequence or 0)  # noqa: E731
        return sorted(self._kept, key=key)[: VerifyResult.MAX_PROBLEMS]


def _event_groups(conn: Connection) -> Iterator[tuple[Row[Any], list[Row[Any]]]]:
    """Each event in seq order with, for admitted / finished / aborted events, its binding and its completions."""
    checked = E.c.kind.in_(_CHECKED_KINDS)
    ending = E.c.kind.in_(_ENDING_KINDS)
    stmt = (
        select(
            *E.c,
            *[col.label(_R + col.name) for col in R.c],
            *[col.label(_C + col.name) for col in C.c],
        )
        .select_from(
            E.outerjoin(R, and_(R.c.request_id == E.c.request_id, checked)).outerjoin(
                C, and_(C.c.request_id == E.c.request_id, ending)
            )
        )
        .order_by(E.c.seq, C.c.completion_index)
    )
    current: Row[Any] | None = None
    completions: list[Row[Any]] = []
    for row in stream(conn, stmt):
        if current is None or row.seq != current.seq:
            if current is not None:
                yield current, completions
            current, completions = row, []
        if getattr(row, _C + "completion_index") is not None:
            completions.append(row)
    if current is not None:
        yield current, completions


def _binding_row(event: Row[Any]) -> dict[str, Any] | None:
    m = event._mapping
    if m[_R + "request_id"] is None:
        return None
    return rows.binding_builtins(rows.request_record(_Prefixed(m, _R)))


class _Prefixed:
    """Attribute access to the prefixed columns of a joined row."""

    def __init__(self, mapping: Any, prefix: str):
        self._m, self._p = mapping, prefix

    def __getattr__(self, name: str) -> Any:
        return self._m[self._p + name]


def _check_admitted(event: Row[Any], found: _Problems) -> None:
    seq, rid, payload = event.seq, event.request_id, event.payload
    binding = payload.get("binding") if isinstance(payload, dict) else None
    if not isinstance(binding, dict):
        found.add(seq, f"request_admitted event for {rid!r} carries no binding", rid)
        return
    if digest(binding) != payload.get("binding_sha256"):
        found.add(seq, f"the binding in the request_admitted event for {rid!r} does not match its binding_sha256", rid)
    if binding.get("request_id") != rid:
        found.add(seq, f"the request_admitted event for {rid!r} carries the binding of {binding.get('request_id')!r}", rid)
    on_record = _binding_row(event)
    if on_record is None:
        found.add(seq, f"request {rid!r} was admitted but its binding row in `requests` is missing", rid)
        return
    expected = rows.binding_builtins(binding)
    differ = sorted(k for k in set(expected) | set(on_record) if expected.get(k) != on_record.get(k))
    if differ:
        found.add(seq, f"the `requests` row of {rid!r} differs from its admitted binding in: {', '.join(differ)}", rid)


def _check_ending(event: Row[Any], completion_rows: list[Row[Any]], found: _Problems) -> None:
    """A finished (or aborted) request: its completions name its adapter and match the event's digest.

    request_finished must carry completions_sha256 and num_completions; request_aborted is checked
    when it carries them (an abort before any output has nothing to vouch for).
    """
    seq, rid, kind = event.seq, event.request_id, event.kind
    payload = event.payload if isinstance(event.payload, dict) else {}
    if kind != EventKind.REQUEST_FINISHED and "completions_sha256" not in payload and not completion_rows:
        return
    bound = event._mapping[_R + "adapter_fingerprint"]
    if event._mapping[_R + "request_id"] is None:
        found.add(seq, f"request {rid!r} ended ({kind}) but its binding row in `requests` is missing", rid)
    else:
        for row in completion_rows:
            got = row._mapping[_C + "adapter_fingerprint"]
            if got != bound:
                index = row._mapping[_C + "completion_index"]
                found.add(seq, f"completion {index} of {rid!r} names adapter {got} but the request is bound to {bound}", rid)
                break
    if "completions_sha256" not in payload:
        if kind == EventKind.REQUEST_FINISHED:
            found.add(seq, f"the request_finished event of {rid!r} carries no completions_sha256", rid)
        return
    expected_n = payload.get("num_completions")
    if expected_n is not None and expected_n != len(completion_rows):
        found.add(seq, f"request {rid!r} ended ({kind}) with {expected_n} completions but {len(completion_rows)} are on record", rid)
        return
    records = [rows.completion_record(row, _C) for row in completion_rows]
    if rows.completions_digest(records) != payload["completions_sha256"]:
        found.add(seq, f"the completions of {rid!r} on record do not match the {kind} event's completions_sha256", rid)


def _first_seq(request_id: Any) -> Any:
    return (
        select(func.min(E.c.seq)).where(E.c.request_id == request_id).correlate_except(E).scalar_subquery()
    )


def _check_unbound(conn: Connection, found: _Problems) -> None:
    """Requests on record that no request_admitted event vouches for."""
    admitted = select(E.c.seq).where(E.c.request_id == R.c.request_id, E.c.kind == EventKind.REQUEST_ADMITTED).exists()
    total = conn.execute(select(func.count()).select_from(R).where(not_(admitted))).scalar_one()
    if not total:
        return
    stmt = select(R.c.request_id, _first_seq(R.c.request_id).label("seq")).where(not_(admitted)).order_by(R.c.request_id)
    for row in stream(conn, stmt.limit(VerifyResult.MAX_PROBLEMS)):
        found.add(row.seq, f"request {row.request_id!r} is in `requests` but has no request_admitted event", row.request_id)
    found.count += max(0, total - VerifyResult.MAX_PROBLEMS)


def _check_completion_adapters(conn: Connection, found: _Problems) -> None:
    """Completions of requests with no ending event whose adapter differs from their request's binding
    (the ordered pass checks those of finished and aborted requests)."""
    ended = select(E.c.seq).where(E.c.request_id == R.c.request_id, E.c.kind.in_(_ENDING_KINDS)).exists()
    stmt = (
        select(C.c.request_id, C.c.completion_index, C.c.adapter_fingerprint, R.c.adapter_fingerprint.label("bound"),
               _first_seq(C.c.request_id).label("seq"))
        .select_from(C.join(R, R.c.request_id == C.c.request_id))
        .where(C.c.adapter_fingerprint.is_distinct_from(R.c.adapter_fingerprint), not_(ended))
        .order_by(C.c.request_id, C.c.completion_index)
        .limit(VerifyResult.MAX_PROBLEMS)
    )
    for row in stream(conn, stmt):
        found.add(
            row.seq,
            f"completion {row.completion_index} of {row.request_id!r} names adapter {row.adapter_fingerprint} "
            f"but the request is bound to {row.bound}",
            row.request_id,
        )
    orphans = (
        select(C.c.request_id, C.c.adapter_fingerprint)
        .select_from(C.outerjoin(A, A.c.fingerprint == C.c.adapter_fingerprint))
        .where(C.c.adapter_fingerprint.is_not(None), A.c.fingerprint.is_(None))
        .limit(VerifyResult.MAX_PROBLEMS)
    )
    for row in stream(conn, orphans):
        found.add(None, f"a completion of {row.request_id!r} names adapter {row.adapter_fingerprint}, which is not in `adapters`", row.request_id)


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
