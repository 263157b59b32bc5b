"""The SQL behind audit queries and exports, built once for both dialects: filters, status, usage, inventory."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
from sqlalchemy import Connection, Row, Select, and_, case, exists, false, func, or_, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import String

from loraledger.audit import results as rec
from loraledger.audit.row_stream import RowStream
from loraledger.errors import ConfigError
from loraledger.store.models import Adapter, Completion, Event, Instance, Request, RequestText, utc_from_unix
from loraledger.store.records import Checkpoint, EventKind

A = Adapter.__table__
R = Request.__table__
C = Completion.__table__
E = Event.__table__
I = Instance.__table__  # noqa: E741 (the tables are A, R, C, E, I throughout)
T = RequestText.__table__

STREAM_BATCH = 1000  # rows per fetch from a server-side cursor
GROUP_KEYS = ("adapter", "tenant", "day")

# The events that move a request's state; its status is the latest of them.
LIFECYCLE_KINDS = tuple(sorted(EventKind.TERMINAL | {EventKind.REQUEST_RESUMED}))
STATUS_OF_KIND = {
    EventKind.REQUEST_FINISHED: rec.FINISHED,
    EventKind.REQUEST_ABORTED: rec.ABORTED,
    EventKind.REQUEST_FAILED: rec.FAILED,
    EventKind.REQUEST_INTERRUPTED: rec.INTERRUPTED,
    EventKind.REQUEST_RESUMED: rec.PENDING,
}


class utc_day(FunctionElement[str]):
    """The UTC calendar day (YYYY-MM-DD text) of a timestamp column."""

    type = String()
    inherit_cache = True


@compiles(utc_day, "sqlite")
def _utc_day_sqlite(element: utc_day, compiler: Any, **kw: Any) -> str:
    # the store keeps SQLite times as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff+00:00'
    return f"substr({compiler.process(list(element.clauses)[0], **kw)}, 1, 10)"


@compiles(utc_day, "postgresql")
def _utc_day_postgresql(element: utc_day, compiler: Any, **kw: Any) -> str:
    return f"to_char(({compiler.process(list(element.clauses)[0], **kw)}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


class iso_text(FunctionElement[str]):
    """A timestamp column as the exports write it, computed by the database: 2026-11-22T13:45:07.123456Z."""

    type = String()
    inherit_cache = True


@compiles(iso_text, "sqlite")
def _iso_text_sqlite(element: iso_text, compiler: Any, **kw: Any) -> str:
    column = compiler.process(list(element.clauses)[0], **kw)
    return f"(substr({column}, 1, 10) || 'T' || substr({column}, 12, 15) || 'Z')"


@compiles(iso_text, "postgresql")
def _iso_text_postgresql(element: iso_text, compiler: Any, **kw: Any) -> str:
    column = compiler.process(list(element.clauses)[0], **kw)
    return f"""to_char(({column}) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"""


class RequestFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which requests a query or report covers; every bound is optional, since inclusive, until exclusive."""

    adapter: str | None = None  # adapter fingerprint, or the lora_name the request was submitted with
    tenant: str | None = None
    since: float | None = None  # unix seconds
    until: float | None = None
    finish_reason: str | None = None  # requests with at least one completion that ended so
    instance: str | None = None  # requests admitted by this engine instance (its id, as `audit instances` lists it)

    def clauses(self) -> list[ColumnElement[bool]]:
        out: list[ColumnElement[bool]] = []
        if self.adapter is not None:
            out.append(or_(R.c.adapter_fingerprint == self.adapter, R.c.lora_name == self.adapter))
        if self.tenant is not None:
            out.append(R.c.tenant == self.tenant)
        if self.instance is not None:
            out.append(R.c.instance_id == self.instance)
        if self.since is not None:
            out.append(R.c.received_at >= utc_from_unix(self.since))
        if self.until is not None:
            out.append(R.c.received_at < utc_from_unix(self.until))
        if self.since is not None and self.until is not None and self.until <= self.since:
            out.append(false())
        if self.finish_reason is not None:
            # an alias: the listing's own FROM already joins completions
            other = C.alias("finish_filter")
            out.append(
                exists().where(other.c.request_id == R.c.request_id, other.c.finish_reason == self.finish_reason)
            )
        return out


def status_kind() -> ColumnElement[str | None]:
    """Per request row: the kind of its latest lifecycle event (None: admitted, nothing since)."""
    return (
        select(E.c.kind)
        .where(E.c.request_id == R.c.request_id, E.c.kind.in_(LIFECYCLE_KINDS))
        .order_by(E.c.seq.desc())
        .limit(1)
        .correlate(R)
        .scalar_subquery()
    )


def status_of(kind: str | None) -> str:
    return STATUS_OF_KIND.get(kind, rec.PENDING) if kind is not None else rec.PENDING


def failed_flag() -> ColumnElement[int]:
    failed = exists().where(E.c.request_id == R.c.request_id, E.c.kind == EventKind.REQUEST_FAILED)
    return case((failed, 1), else_=0)


def stream(conn: Connection, stmt: Select[Any]) -> Iterator[Row[Any]]:
    """Rows of stmt fetched in batches through a server-side cursor (where the dialect has one)."""
    result = conn.execution_options(yield_per=STREAM_BATCH).execute(stmt)
    try:
        yield from result
    finally:
        result.close()


# Completion columns joined to their request are labelled with this prefix (they share names with the request's).
COMPLETION_PREFIX = "c_"


def _kept_text(request_id: Any, part: str, idx: Any) -> Any:
    """The text a `request_texts` row keeps (revision 0013 on), NULL once erased."""
    return (
        select(T.c.text)
        .where(T.c.request_id == request_id, T.c.part == part, T.c.idx == idx)
        .correlate_except(T)
        .scalar_subquery()
    )


# columns whose text a salted row keeps in `request_texts`: column -> (its part, the commitment that says so)
_SALTED_COMPLETION_COLUMNS = {
    "text": ("completion", "text_commitment"),
    "tool_calls": ("tool_calls", "tool_calls_commitment"),
}
_SALTED_REQUEST_COLUMNS = {
    "prompt_text": ("prompt", "prompt_token_ids_commitment"),
    "tools_text": ("tools", "tools_commitment"),
    "constraint_text": ("constraint", "constraint_commitment"),
}


def completion_column(name: str) -> ColumnElement[Any]:
    """A completions column as listings and reports show it: `text` and `tool_calls` of a salted row are read from
    `request_texts` (NULL once erased)."""
    if name in _SALTED_COMPLETION_COLUMNS:
        part, commitment = _SALTED_COMPLETION_COLUMNS[name]
        kept = _kept_text(C.c.request_id, part, C.c.completion_index)
        return case((C.c[commitment].is_(None), C.c[name]), else_=kept).label(COMPLETION_PREFIX + name)
    return C.c[name].label(COMPLETION_PREFIX + name)


def request_column(name: str) -> ColumnElement[Any]:
    """A requests column as listings and reports show it: `caller_request_id` is the caller's id, which for a row from
    before revision 0006 is its request_id (as the request_lineage view and `audit show` read it); `prompt_text` of a
    salted binding is read from `request_texts` (NULL once erased, as where prompts are not kept as text), and so are
    `tools_text` and `constraint_text` where the binding commits to them (revision 0016)."""
    if name == "caller_request_id":
        return func.coalesce(R.c.caller_request_id, R.c.request_id).label(name)
    if name in _SALTED_REQUEST_COLUMNS:
        part, commitment = _SALTED_REQUEST_COLUMNS[name]
        kept = _kept_text(R.c.request_id, part, 0)
        return case((R.c[commitment].is_(None), R.c[name]), else_=kept).label(name)
    return R.c[name]


def request_groups(
    conn: Connection,
    flt: RequestFilter,
    *,
    request_columns: Sequence[ColumnElement[Any]],
    completion_columns: Sequence[ColumnElement[Any]],
) -> Iterator[tuple[Row[Any], Iterator[Row[Any]]]]:
    """Each matching request, in received order, with an iterator over its completions in index order.

    A request row has `request_id`, `status_kind` and the request columns asked for; a completion
    row has `request_id`, `c_completion_index` and the completion columns (labelled with
    COMPLETION_PREFIX). Two cursors in the same order, read side by side: a request's columns come
    once however many completions it has, and nothing but the current row of each is held, so a
    request with a large n streams like many small ones. Read the completions of a request before
    asking for the next request (what is left unread is skipped); run it in one snapshot
    (AuditLog.snapshot), so that both cursors see the same rows.
    """
    order = (R.c.received_at, R.c.request_id)
    requests = (
        select(R.c.request_id, *request_columns, status_kind().label("status_kind"))
        .where(*flt.clauses())
        .order_by(*order)
    )
    completions = (
        select(R.c.request_id, completion_column("completion_index"), *completion_columns)
        .select_from(R.join(C, C.c.request_id == R.c.request_id))
        .where(*flt.clauses())
        .order_by(*order, C.c.completion_index)
    )
    rows = RowStream(stream(conn, completions))
    try:
        for request in stream(conn, requests):
            rid = request.request_id
            yield request, rows.take_while(lambda row, rid=rid: row.request_id == rid)
            for _ in rows.take_while(lambda row, rid=rid: row.request_id == rid):  # what the caller left unread
                pass
    finally:
        rows.close()


def count_requests(conn: Connection, flt: RequestFilter) -> int:
    return int(conn.execute(select(func.count()).select_from(R).where(*flt.clauses())).scalar_one())


def usage_statement(flt: RequestFilter, group_by: Sequence[str]) -> Select[Any]:
    """Requests, prompt tokens, generated tokens and failed requests per group of group_by (GROUP_KEYS)."""
    unknown = [key for key in group_by if key not in GROUP_KEYS]
    if unknown or len(set(group_by)) != len(group_by):
        raise ConfigError(f"group_by takes distinct keys from {', '.join(GROUP_KEYS)}; got {', '.join(group_by)}")
    generated = (
        select(func.coalesce(func.sum(C.c.generated_token_count), 0))
        .where(C.c.request_id == R.c.request_id)
        .correlate(R)
        .scalar_subquery()
    )
    per_request = (
        select(
            R.c.adapter_fingerprint,
            R.c.tenant,
            utc_day(R.c.received_at).label("day"),
            R.c.prompt_token_count,
            generated.label("generated"),
            failed_flag().label("failed"),
        )
        .where(*flt.clauses())
        .subquery("per_request")
    )
    keys: list[ColumnElement[Any]] = []
    if "adapter" in group_by:
        keys += [per_request.c.adapter_fingerprint, A.c.name]
    if "tenant" in group_by:
        keys.append(per_request.c.tenant)
    if "day" in group_by:
        keys.append(per_request.c.day)
    stmt = select(
        *keys,
        func.count().label("requests"),
        func.coalesce(func.sum(per_request.c.prompt_token_count), 0).label("prompt_tokens"),
        func.coalesce(func.sum(per_request.c.generated), 0).label("generated_tokens"),
        func.coalesce(func.sum(per_request.c.failed), 0).label("errors"),
    ).select_from(per_request.outerjoin(A, A.c.fingerprint == per_request.c.adapter_fingerprint))
    if keys:
        # NULL (the base model, no tenant) sorts last on both dialects
        stmt = stmt.group_by(*keys).order_by(*[key.asc().nulls_last() for key in keys])
    return stmt


def usage_row(row: Row[Any]) -> rec.UsageRow:
    m = row._mapping
    return rec.UsageRow(
        adapter_fingerprint=m.get("adapter_fingerprint"),
        lora_name=m.get("name"),
        tenant=m.get("tenant"),
        day=m.get("day"),
        requests=int(m["requests"]),
        prompt_tokens=int(m["prompt_tokens"]),
        generated_tokens=int(m["generated_tokens"]),
        errors=int(m["errors"]),
    )


def adapters_statement(fingerprints: Sequence[str] | None = None) -> Select[Any]:
    """The adapter inventory with each adapter's request count and first / last request time."""
    use = (
        select(
            R.c.adapter_fingerprint.label("fingerprint"),
            func.count().label("requests"),
            func.min(R.c.received_at).label("first_used"),
            func.max(R.c.received_at).label("last_used"),
        )
        .where(R.c.adapter_fingerprint.is_not(None))
        .group_by(R.c.adapter_fingerprint)
        .subquery("use")
    )
    stmt = (
        select(A, func.coalesce(use.c.requests, 0).label("requests"), use.c.first_used, use.c.last_used)
        .select_from(A.outerjoin(use, use.c.fingerprint == A.c.fingerprint))
        .order_by(A.c.name, A.c.fingerprint)
    )
    if fingerprints is not None:
        stmt = stmt.where(A.c.fingerprint.in_(list(fingerprints)) if fingerprints else false())
    return stmt


def events_window(flt: RequestFilter) -> Select[Any]:
    """First and last event sequence numbers whose time lies in the filter's window."""
    clauses: list[ColumnElement[bool]] = []
    if flt.since is not None:
        clauses.append(E.c.at >= utc_from_unix(flt.since))
    if flt.until is not None:
        clauses.append(E.c.at < utc_from_unix(flt.until))
    return select(func.min(E.c.seq), func.max(E.c.seq)).where(*clauses)


def request_ids_of_caller_id(conn: Connection, caller_request_id: str, limit: int) -> tuple[list[str], int]:
    """The audit keys of the first `limit` requests submitted with this caller request id, in received order, and how
    many there are in all (a caller may reuse an id once its request has finished; rows from before revision 0006
    hold NULL there: their key is their caller id, and they are found by it)."""
    legacy = and_(R.c.caller_request_id.is_(None), R.c.request_id == caller_request_id)
    match = or_(R.c.caller_request_id == caller_request_id, legacy)
    total = conn.execute(select(func.count()).select_from(R).where(match)).scalar_one()
    if not total:
        return [], 0
    stmt = select(R.c.request_id).where(match).order_by(R.c.received_at, R.c.request_id).limit(limit)
    return list(conn.execute(stmt).scalars()), int(total)


def request_ids_with_prefix(conn: Connection, prefix: str, limit: int) -> list[str]:
    """Up to limit request ids that start with prefix (exactly: SQLite's LIKE ignores ASCII case), in id order."""
    stmt = select(R.c.request_id).where(R.c.request_id.startswith(prefix, autoescape=True)).order_by(R.c.request_id)
    found: list[str] = []
    for (request_id,) in stream(conn, stmt):
        if request_id.startswith(prefix):
            found.append(request_id)
            if len(found) == limit:
                break
    return found


def head(conn: Connection) -> Checkpoint | None:
    """The last event's sequence number, hash and time; None for an empty log."""
    row = conn.execute(select(E.c.seq, E.c.hash, E.c.at).order_by(E.c.seq.desc()).limit(1)).first()
    return None if row is None else Checkpoint(sequence=row.seq, hash=row.hash, at=row.at.timestamp())


def unix(value: dt.datetime | None) -> float | None:
    return None if value is None else value.timestamp()
