"""Rows that no event vouches for: requests, adapters, instances, completions and lease claims off the chain.

Each check counts every such row and reports the first MAX_PROBLEMS, so a log of any size is checked in
bounded memory.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, not_, select

from loraledger.audit.event_rows import ENDING_KINDS
from loraledger.audit.problems import Problems
from loraledger.audit.queries import A, C, E, I, R, stream
from loraledger.audit.results import VerifyResult
from loraledger.store import instances
from loraledger.store.records import EventKind
from loraledger.store.registration import is_registered

_UPGRADE_HINT = "a log written before revision 0004 needs `loraledger db upgrade`"


def _first_seq(request_id: Any) -> Any:
    return select(func.min(E.c.seq)).where(E.c.request_id == request_id).correlate_except(E).scalar_subquery()


def check_unbound(conn: Connection, found: Problems) -> None:
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


def check_unregistered(conn: Connection, found: Problems) -> None:
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


def check_unregistered_instances(conn: Connection, found: Problems) -> None:
    """`instances` rows that no instance_registered event vouches for."""
    query = instances.unregistered(I, E)
    total = conn.execute(select(func.count()).select_from(query.subquery())).scalar_one()
    if not total:
        return
    for iid in conn.execute(query.limit(VerifyResult.MAX_PROBLEMS)).scalars():
        found.add(None, f"instance {iid} is in `instances` but no instance_registered event vouches for it",
                  table="instances", key={"instance_id": iid})  # fmt: skip
    found.count += max(0, total - VerifyResult.MAX_PROBLEMS)


def check_unclaimed_recoveries(conn: Connection, claims: set[tuple[str, str]], found: Problems) -> None:
    """Leases that name an instance (or a tool) as their recoverer when no engine_recovered event of it claims them."""
    for iid, claimer in stream(conn, instances.recovered_leases()):
        if (claimer, iid) not in claims:
            found.add(None, f"the lease of instance {iid} in `instance_leases` names {claimer} as the one that recovered it, "
                      "but no engine_recovered event of it claims that instance", table="instance_leases", key={"instance_id": iid})  # fmt: skip


def check_stop_markers(conn: Connection, found: Problems) -> None:
    """Clean-stop lease markers against the instance_stopped events that vouch for them (store/instances.py)."""
    for iid, problem in stream(conn, instances.unvouched_stops(E).limit(VerifyResult.MAX_PROBLEMS)):
        if problem == "forged":
            what = (f"the lease of instance {iid} in `instance_leases` says it stopped cleanly, but no instance_stopped "
                    "event vouches for that: its unfinished requests may be hidden from recovery")  # fmt: skip
        else:
            what = (f"instance {iid} stopped cleanly (its instance_stopped event is on the chain), but its lease in "
                    "`instance_leases` no longer says so: the stop marker was erased or altered")  # fmt: skip
        found.add(None, what, table="instance_leases", key={"instance_id": iid})


def check_unvouched_completions(conn: Connection, found: Problems) -> None:
    """Completions of requests with no request_finished or request_aborted event: nothing vouches for them."""
    ended = select(E.c.seq).where(E.c.request_id == C.c.request_id, E.c.kind.in_(ENDING_KINDS)).exists()
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


def check_completion_adapters(conn: Connection, found: Problems) -> None:
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
