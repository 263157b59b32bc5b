"""Retention: what the log holds that is older than a policy's minimum (the EU AI Act asks for at least six months)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec
from sqlalchemy import Connection, func, select

from loraledger.audit.queries import C, R, request_column
from loraledger.errors import ConfigError

DEFAULT_KEEP_DAYS = 183  # six months, the EU AI Act's minimum for automatically generated logs (Arts. 19, 26(6))


class TenantRetention(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str | None
    requests: int
    completions: int
    prompts_with_text: int  # requests whose prompt is kept as text
    oldest: float  # unix time of the oldest request


class RetentionReport(msgspec.Struct, frozen=True, kw_only=True):
    keep_days: int
    cutoff: float  # unix time: requests received before it are past the minimum retention
    past: list[TenantRetention]  # per tenant, the requests past the minimum retention

    @property
    def total(self) -> int:
        return sum(t.requests for t in self.past)


def retention_report(
    conn: Connection, keep_days: int = DEFAULT_KEEP_DAYS, *, now: float | None = None
) -> RetentionReport:
    if not isinstance(keep_days, int) or keep_days < 0:
        raise ConfigError(f"keep_days must be a whole number of days >= 0, got {keep_days!r}")
    now_dt = dt.datetime.now(dt.timezone.utc) if now is None else dt.datetime.fromtimestamp(now, dt.timezone.utc)
    cutoff = now_dt - dt.timedelta(days=keep_days)
    completions = select(C.c.request_id, func.count().label("n")).group_by(C.c.request_id).subquery()
    query = (
        select(
            R.c.tenant,
            func.count().label("requests"),
            func.coalesce(func.sum(completions.c.n), 0).label("completions"),
            func.count(request_column("prompt_text")).label("prompts_with_text"),
            func.min(R.c.received_at).label("oldest"),
        )
        .select_from(R.outerjoin(completions, completions.c.request_id == R.c.request_id))
        .where(R.c.received_at < cutoff)
        .group_by(R.c.tenant)
        .order_by(R.c.tenant)
    )
    rows: list[Any] = conn.execute(query).all()
    past = [
        TenantRetention(tenant=r.tenant, requests=int(r.requests), completions=int(r.completions),
                        prompts_with_text=int(r.prompts_with_text), oldest=r.oldest.timestamp())
        for r in rows
    ]  # fmt: skip
    return RetentionReport(keep_days=keep_days, cutoff=cutoff.timestamp(), past=past)
