"""Erasure: make the prompt and completion text of some requests unrecoverable while the log still verifies.

The same goes for the caller content kept beside it from revision 0016 on: tool definitions, constraint text and
each completion's tool calls (their arguments), each in a `request_texts` row of its own.

Text written from revision 0013 on lives in `request_texts`, each row under its own random salt; the chain, the
tree and the receipts hold only sha256(salt || text) commitments (and the token counts). `erase` deletes those
rows, salts included, in one transaction under the writers' lock that also appends an `erased` event (who, why,
which selector, how many requests, prompts and completions, and a digest of the erased requests' audit keys) and
one `erasures` row per request naming that event. The database's guard lets a text row go only when such an
`erasures` row naming an `erased` event exists (store/guards.py); every other audit row stays append-only.

`before` refuses to reach inside the minimum retention (default 183 days, `audit retention`'s policy) unless
`force` is given with a `reason`, which goes on record in the event.
"""

from __future__ import annotations

import datetime as dt
import getpass
import socket
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from sqlalchemy import Connection, delete, func, insert, select

from loraledger.audit import content_checks
from loraledger.audit.queries import C, E, R
from loraledger.audit.retention import DEFAULT_KEEP_DAYS
from loraledger.digests import erased_requests_digest
from loraledger.errors import ConfigError
from loraledger.store.audit_store import append_events
from loraledger.store.db import take_writer_lock
from loraledger.store.models import Erasure, RequestText, utc_from_unix
from loraledger.store.records import EventKind, EventRecord

T = RequestText.__table__
X = Erasure.__table__
_CHUNK = 300
MAX_REASON_CHARS = 2000


class Erased(msgspec.Struct, frozen=True, kw_only=True):
    """What one erasure did: its `erased` event (None when there was nothing to erase) and its counts."""

    seq: int | None
    requests: int
    prompts: int
    completions: int
    text_rows: int  # `request_texts` rows deleted
    kept_inline: int  # matching requests written before revision 0013: their text is in the chain's rows, kept


def default_actor() -> str:
    """Who erases, as the event records it by default: the OS user at this host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _selector(tenant: str | None, request_id: str | None, before: float | None) -> Any:
    given = [
        name for name, value in (("tenant", tenant), ("request", request_id), ("before", before)) if value is not None
    ]
    if len(given) != 1:
        raise ConfigError(
            f"erase takes exactly one of --tenant, --request, --before (got {', '.join(given) or 'none'})"
        )
    if tenant is not None:
        return R.c.tenant == tenant
    if request_id is not None:
        return R.c.request_id == request_id
    return R.c.received_at < utc_from_unix(before)


def _check_retention(before: float | None, keep_days: int, force: bool, reason: str | None, now: float) -> None:
    if before is None:
        return
    cutoff = now - keep_days * 86400
    if before > cutoff and not (force and reason):
        at = dt.datetime.fromtimestamp(cutoff, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        raise ConfigError(
            f"--before reaches inside the minimum retention of {keep_days} days (requests received since {at} must be "
            "kept); choose an earlier date, or pass --force with --reason, which goes on record"
        )


def _chunks(items: Sequence[str]) -> Any:
    for start in range(0, len(items), _CHUNK):
        yield list(items[start : start + _CHUNK])


def erase(
    conn: Connection,
    *,
    tenant: str | None = None,
    request_id: str | None = None,
    before: float | None = None,
    reason: str | None = None,
    force: bool = False,
    by: str | None = None,
    keep_days: int = DEFAULT_KEEP_DAYS,
    now: float | None = None,
) -> Erased:
    """Erase the text of the requests selected (one of tenant, request_id, before: unix seconds), on conn inside
    db.write_transaction. Refuses (ConfigError) a `before` inside the retention unless forced with a reason."""
    if not isinstance(keep_days, int) or keep_days < 0:
        raise ConfigError(f"keep_days must be a whole number of days >= 0, got {keep_days!r}")
    if reason is not None and len(reason) > MAX_REASON_CHARS:
        raise ConfigError(f"the reason is {len(reason)} characters; keep it under {MAX_REASON_CHARS}")
    if force and not reason:
        raise ConfigError("--force needs --reason: why the minimum retention is overridden goes on record")
    now = time.time() if now is None else now
    where = _selector(tenant, request_id, before)
    _check_retention(before, keep_days, force, reason, now)
    take_writer_lock(conn)
    if request_id is not None and conn.execute(select(R.c.request_id).where(where)).first() is None:
        raise ConfigError(f"no request {request_id!r} is on record (erase takes the audit key, RequestOutput.audit_id)")
    has_text = select(T.c.request_id).where(T.c.request_id == R.c.request_id).exists()
    erased_before = select(X.c.request_id).where(X.c.request_id == R.c.request_id).exists()
    # a request still running would write completion text after its erasure: only ended requests are erased, and
    # one interrupted and then resumed has not ended until an ending after its resumption (store/texts.py refuses
    # the text of an erased request, so a resumption after the erasure does not run)
    ended = select(E.c.seq).where(E.c.request_id == R.c.request_id, E.c.kind.in_(sorted(EventKind.TERMINAL))).exists()
    later = E.alias("resumed")
    resumed_after = select(later.c.seq).where(later.c.request_id == R.c.request_id,
        later.c.kind == EventKind.REQUEST_RESUMED,
        later.c.seq > select(func.max(E.c.seq)).where(E.c.request_id == R.c.request_id,
            E.c.kind.in_(sorted(EventKind.TERMINAL))).scalar_subquery()).exists()  # fmt: skip
    ended = ended & ~resumed_after
    query = select(R.c.request_id).where(where, has_text, ~erased_before, ended).order_by(R.c.request_id)
    ids = list(conn.execute(query).scalars())
    # text in rows the chain covers (before revision 0013; tools, constraint and calls before 0016): kept, counted
    inline = select(func.count()).select_from(R).where(where, (R.c.prompt_text.is_not(None))
        | R.c.tools_text.is_not(None) | R.c.constraint_text.is_not(None) | R.c.request_id.in_(select(C.c.request_id)
            .where(((C.c.text_commitment.is_(None)) & (C.c.text != "")) | C.c.tool_calls.is_not(None))))  # fmt: skip
    kept_inline = int(conn.execute(inline).scalar_one())
    if not ids:
        return Erased(seq=None, requests=0, prompts=0, completions=0, text_rows=0, kept_inline=kept_inline)
    prompts = completions = 0
    content = {"tools": 0, "constraints": 0, "tool_calls": 0}
    for chunk in _chunks(ids):
        prompts += conn.execute(select(func.count()).select_from(R).where(
            R.c.request_id.in_(chunk), R.c.prompt_token_ids_commitment.is_not(None))).scalar_one()  # fmt: skip
        completions += conn.execute(select(func.count()).select_from(C).where(
            C.c.request_id.in_(chunk), C.c.text_commitment.is_not(None))).scalar_one()  # fmt: skip
        for name, n in content_checks.counts(conn, chunk).items():
            content[name] += n
    selector = {"tenant": tenant, "request_id": request_id,
                "before": None if before is None else utc_from_unix(before)}  # fmt: skip
    payload = {"by": by or default_actor(), "reason": reason, "selector": selector, "forced": bool(force),
               "keep_days": keep_days, "requests": len(ids), "prompts": int(prompts), "completions": int(completions),
               "requests_sha256": erased_requests_digest(ids), **content}  # fmt: skip
    head = append_events(conn, [EventRecord(kind=EventKind.ERASED, at=now, payload=payload)])
    rows = 0
    for chunk in _chunks(ids):
        conn.execute(insert(X), [{"request_id": rid, "seq": head.sequence} for rid in chunk])
        rows += conn.execute(delete(T).where(T.c.request_id.in_(chunk))).rowcount
    return Erased(seq=head.sequence, requests=len(ids), prompts=int(prompts), completions=int(completions),
                  text_rows=rows, kept_inline=kept_inline)  # fmt: skip
