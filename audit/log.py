"""AuditLog: read-only, streaming queries over the audit database (lineage, listings, usage, inventory, verify)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
from sqlalchemy import Connection, Engine, select
from sqlalchemy.engine import URL

from loraledger.audit import queries as q
from loraledger.audit import typed_rows as rows
from loraledger.audit.kept_text import with_kept_text
from loraledger.audit.results import AdapterInfo, EventEntry, RequestLineage, RequestRow, UsageRow, VerifyResult
from loraledger.audit.timefmt import Instant, to_unix
from loraledger.audit.verify import read_checkpoint, verify_log
from loraledger.errors import (
    AmbiguousRequestIdError,
    AuditCorruptError,
    AuditSchemaError,
    AuditUnavailableError,
    LoraLedgerError,
    UnknownRequestError,
)
from loraledger.store.db import display_url, make_engine, normalize_url, unavailable_as_error
from loraledger.store.instances import SOURCE_FIELDS, LeaseState, lease_states
from loraledger.store.migrate import current_revision
from loraledger.store.records import Checkpoint

_LISTING_REQUEST_COLUMNS = (
    "caller_request_id",
    "received_at",
    "tenant",
    "adapter_fingerprint",
    "lora_name",
    "lora_int_id",
    "prompt_token_count",
    "instance_id",
)
AMBIGUOUS_SHOWN = 10  # candidates an ambiguous prefix error lists
SHOWN_PER_CALLER_ID = 100  # `audit show CALLER-ID`: the lineages shown of the requests that used one caller id
MIN_PREFIX_CHARS = 4  # shorter text is never taken as an audit-key prefix (every key starts with "0")
# how match_request found its requests
KEY, CALLER_ID, PREFIX = "audit key", "caller request id", "audit key prefix"


class RequestMatch(msgspec.Struct, frozen=True):
    kind: str  # KEY, CALLER_ID or PREFIX
    keys: list[str]  # the audit keys matched (for CALLER_ID, the first `limit` in received order)
    total: int  # how many requests matched in all


_LISTING_COMPLETION_COLUMNS = ("finish_reason", "generated_token_count", "finished_at")


class AuditLog:
    """The audit log at url, for reading. Never writes and never migrates.

    Listings are generators that stream from a server-side cursor: iterate them to the end (or
    close them) before the AuditLog is closed.
    """

    def __init__(self, url: str | URL | None = None):
        if url is None:
            from loraledger.cli import default_url

            url = default_url()
        self.url = url
        self._engine: Engine | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def open(self) -> AuditLog:
        if self._engine is not None:
            return self
        parsed = normalize_url(self.url)
        database = parsed.database
        if (
            parsed.get_backend_name() == "sqlite"
            and database
            and database != ":memory:"
            and not database.startswith("file:")
        ):
            if not Path(database).exists():
                raise AuditUnavailableError(
                    f"there is no audit database at {display_url(self.url)}: the file does not exist; "
                    "pass --url (or set $LORALEDGER_AUDIT_URL) to the engine's audit_url"
                )
        with unavailable_as_error(self.url):
            engine = make_engine(self.url)
            try:
                with engine.connect() as conn:
                    revision = current_revision(conn)
            except BaseException:
                engine.dispose()
                raise
        if revision is None:
            engine.dispose()
            raise AuditSchemaError(
                f"the database at {display_url(self.url)} holds no loraledger audit log (no schema revision); "
                "check the URL"
            )
        self._engine = engine
        return self

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def __enter__(self) -> AuditLog:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engine(self) -> Engine:
        return self.open()._engine  # type: ignore[return-value]

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Connection]:
        """A read-only connection whose queries all see one state of the log (a repeatable-read transaction)."""
        with self._connect() as conn, unavailable_as_error(self.url):
            if conn.dialect.name == "postgresql":
                conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
            with conn.begin():
                yield conn

    @contextlib.contextmanager
    def _readable(self) -> Iterator[None]:
        """A value that cannot be read (a row edited behind the guards) is AuditCorruptError, not a traceback;
        `verify` reads such rows defensively and names them."""
        try:
            yield
        except LoraLedgerError:
            raise
        except (TypeError, ValueError) as exc:
            raise AuditCorruptError(
                f"the audit log at {display_url(self.url)} holds a value that cannot be read ({type(exc).__name__}: {exc}); "
                "`loraledger audit verify` names the row"
            ) from exc

    def _connect(self) -> Connection:
        with unavailable_as_error(self.url):
            return self.engine.connect()

    # -- queries ---------------------------------------------------------------------------

    def request(self, request_id: str) -> RequestLineage:
        """The full lineage of one request: binding, adapter, completions in index order, events in seq order."""
        with self.snapshot() as conn, self._readable():
            binding_row = conn.execute(select(q.R).where(q.R.c.request_id == request_id)).first()
            if binding_row is None:
                raise UnknownRequestError(f"request {request_id!r} is not in the audit log at {display_url(self.url)}")
            binding = rows.request_record(binding_row)
            adapter = None
            if binding.adapter_fingerprint is not None:
                adapter_row = conn.execute(select(q.A).where(q.A.c.fingerprint == binding.adapter_fingerprint)).first()
                adapter = None if adapter_row is None else rows.adapter_record(adapter_row)
            completions = [
                rows.completion_record(row)
                for row in conn.execute(
                    select(q.C).where(q.C.c.request_id == request_id).order_by(q.C.c.completion_index)
                )
            ]
            binding, completions, erased = with_kept_text(conn, binding, completions)
            model_source = None
            if binding_row.instance_id is not None:
                columns = [q.I.c[name] for name in SOURCE_FIELDS]
                found = conn.execute(select(*columns).where(q.I.c.instance_id == binding_row.instance_id)).first()
                model_source = None if found is None else dict(found._mapping)
            events = [
                EventEntry(
                    sequence=row.seq,
                    kind=row.kind,
                    at=row.at.timestamp(),
                    request_id=row.request_id,
                    payload=row.payload,
                    prev_hash=row.prev_hash,
                    hash=row.hash,
                )
                for row in conn.execute(select(q.E).where(q.E.c.request_id == request_id).order_by(q.E.c.seq))
            ]
        kinds = [e.kind for e in events if e.kind in q.LIFECYCLE_KINDS]
        status = q.status_of(kinds[-1] if kinds else None)
        return RequestLineage(
            binding=binding,
            adapter=adapter,
            completions=completions,
            events=events,
            status=status,
            instance_id=binding_row.instance_id,
            model_source=model_source,
            erased_seq=erased,
        )

    def match_request(
        self, text: str, limit: int = SHOWN_PER_CALLER_ID, *, caller_id_only: bool = False
    ) -> RequestMatch:
        """The requests text names, and how: an exact audit key always wins (whatever a caller chose as its own request
        id); only when none matches are caller ids (every request that used text, in received order: a caller may
        reuse an id once its request has finished; the first `limit` of them) and audit-key prefixes of at least
        MIN_PREFIX_CHARS characters looked up. If both kinds match, or a prefix matches several keys, nothing is
        chosen: AmbiguousRequestIdError lists every candidate with its kind. caller_id_only: text is a caller id.

        Raises UnknownRequestError when no request matches.
        """
        with self.snapshot() as conn:
            if not caller_id_only and conn.execute(select(q.R.c.request_id).where(q.R.c.request_id == text)).first():
                return RequestMatch(KEY, [text], 1)
            keys, total = q.request_ids_of_caller_id(conn, text, limit)
            prefixed = (
                q.request_ids_with_prefix(conn, text, AMBIGUOUS_SHOWN + 1)
                if len(text) >= MIN_PREFIX_CHARS and not caller_id_only
                else []
            )
        prefixed = [k for k in prefixed if k not in keys]
        if keys and not prefixed:
            return RequestMatch(CALLER_ID, keys, total)
        if len(prefixed) == 1 and not keys:
            return RequestMatch(PREFIX, prefixed, 1)
        if not prefixed:
            raise UnknownRequestError(f"request {text!r} is not in the audit log at {display_url(self.url)}")

        def listed(found: list[str], more: bool) -> str:
            return ", ".join(found[:AMBIGUOUS_SHOWN]) + (", ..." if more or len(found) > AMBIGUOUS_SHOWN else "")

        if not keys:
            more = "more than " if len(prefixed) > AMBIGUOUS_SHOWN else ""
            raise AmbiguousRequestIdError(
                f"request id prefix {text!r} is ambiguous: it matches {more}{min(len(prefixed), AMBIGUOUS_SHOWN)} "
                f"requests ({listed(prefixed, False)}); give more of the id"
            )
        raise AmbiguousRequestIdError(
            f"{text!r} names different requests as a caller request id ({listed(keys, total > len(keys))}) and as an "
            f"audit key prefix ({listed(prefixed, False)}); give the whole audit key, or pass --caller-id to take it "
            "as the caller's id"
        )

    def resolve_request_ids(self, text: str, limit: int = SHOWN_PER_CALLER_ID) -> tuple[list[str], int]:
        """The audit keys of the requests text names, in received order, and how many there are (see match_request)."""
        match = self.match_request(text, limit)
        return match.keys, match.total

    def resolve_request_id(self, text: str) -> str:
        """The one request text names (see match_request); AmbiguousRequestIdError when a caller id names several."""
        keys, _ = self.resolve_request_ids(text)
        if len(keys) > 1:
            listed = ", ".join(keys[:AMBIGUOUS_SHOWN]) + (", ..." if len(keys) > AMBIGUOUS_SHOWN else "")
            raise AmbiguousRequestIdError(
                f"caller request id {text!r} was used by {len(keys)} requests (audit keys {listed}); give an audit key"
            )
        return keys[0]

    def requests(
        self,
        *,
        adapter: str | None = None,
        tenant: str | None = None,
        since: Instant = None,
        until: Instant = None,
        finish_reason: str | None = None,
        limit: int | None = None,
        instance: str | None = None,
    ) -> Iterator[RequestRow]:
        """Requests in received order; adapter is a fingerprint or the lora_name submitted; since inclusive, until exclusive;
        instance: only the requests that engine instance admitted."""
        flt = q.RequestFilter(
            adapter=adapter,
            tenant=tenant,
            instance=instance,
            since=to_unix(since, what="since"),
            until=to_unix(until, what="until"),
            finish_reason=finish_reason,
        )
        return self._request_rows(flt, limit)

    def _request_rows(self, flt: q.RequestFilter, limit: int | None) -> Iterator[RequestRow]:
        if limit is not None and limit <= 0:
            return
        with self.snapshot() as conn, self._readable():
            groups = q.request_groups(
                conn,
                flt,
                request_columns=[q.request_column(name) for name in _LISTING_REQUEST_COLUMNS],
                completion_columns=[q.completion_column(name) for name in _LISTING_COMPLETION_COLUMNS],
            )
            with contextlib.closing(groups):  # the cursors close while their connection is open
                for n, (request, completions) in enumerate(groups, start=1):
                    yield request_row(request, completions)
                    if limit is not None and n >= limit:
                        return

    def usage(
        self,
        *,
        group_by: Sequence[str] = q.GROUP_KEYS,
        since: Instant = None,
        until: Instant = None,
        adapter: str | None = None,
        tenant: str | None = None,
        instance: str | None = None,
    ) -> Iterator[UsageRow]:
        """Requests, prompt tokens, generated tokens and failed requests per group (adapter, tenant, UTC day)."""
        flt = q.RequestFilter(
            adapter=adapter,
            tenant=tenant,
            instance=instance,
            since=to_unix(since, what="since"),
            until=to_unix(until, what="until"),
        )
        stmt = q.usage_statement(flt, tuple(group_by))
        with self._connect() as conn, unavailable_as_error(self.url):
            for row in q.stream(conn, stmt):
                yield q.usage_row(row)

    def adapters(self, fingerprints: Sequence[str] | None = None) -> Iterator[AdapterInfo]:
        """The adapter inventory (all, or those fingerprints) with request counts and first / last use."""
        with self._connect() as conn, unavailable_as_error(self.url), self._readable():
            for row in q.stream(conn, q.adapters_statement(fingerprints)):
                yield adapter_info(row)

    def instances(self) -> list[LeaseState]:
        """Every engine instance that has written to this log, oldest start first, with its lease (live, expired,
        stopped, recovered) by the database's clock."""
        with self._connect() as conn, unavailable_as_error(self.url), self._readable():
            return lease_states(conn)

    def head(self) -> Checkpoint | None:
        """The last event's sequence number, hash and time; None for an empty log."""
        with self._connect() as conn, unavailable_as_error(self.url):
            return q.head(conn)

    def verify(self, checkpoint: Checkpoint | str | Path | None = None) -> VerifyResult:
        """Recompute the hash chain and check every binding and completion; checkpoint: a Checkpoint or its file."""
        if isinstance(checkpoint, (str, Path)):
            checkpoint = read_checkpoint(checkpoint)
        with self.snapshot() as conn:
            return verify_log(conn, checkpoint)


def request_row(request: Any, completions: Iterable[Any]) -> RequestRow:
    """A listing line from a request_groups() item (its completions read as they stream)."""
    reasons: set[str] = set()
    count = generated = 0
    finished = None
    for c in completions:
        count += 1
        reasons.add(c.c_finish_reason)
        generated += c.c_generated_token_count
        finished = c.c_finished_at if finished is None else max(finished, c.c_finished_at)
    return RequestRow(
        request_id=request.request_id,
        caller_request_id=request.caller_request_id,
        received_at=request.received_at.timestamp(),
        tenant=request.tenant,
        adapter_fingerprint=request.adapter_fingerprint,
        lora_name=request.lora_name,
        lora_int_id=request.lora_int_id,
        prompt_token_count=request.prompt_token_count,
        num_completions=count,
        generated_tokens=generated,
        finish_reasons=",".join(sorted(reasons)) if reasons else None,
        status=q.status_of(request.status_kind),
        finished_at=finished.timestamp() if finished is not None else None,
        instance_id=request.instance_id,
    )


def adapter_info(row: Any) -> AdapterInfo:
    return AdapterInfo(
        record=rows.adapter_record(row),
        requests=int(row.requests),
        first_used=q.unix(row.first_used),
        last_used=q.unix(row.last_used),
    )
