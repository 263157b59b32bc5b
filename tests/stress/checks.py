"""What must hold in an audit log after a crash, and after the next engine start on it: lists of problems (empty: all good)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from sqlalchemy import func, select

from loraledger.store.audit_store import COMPLETIONS, EVENTS, REQUESTS, AuditStore
from loraledger.store.records import EventKind

WITH_COMPLETIONS = (EventKind.REQUEST_FINISHED, EventKind.REQUEST_ABORTED)
END_KINDS = (*WITH_COMPLETIONS, EventKind.REQUEST_FAILED)


def log_problems(url: str, admitted: set[str], released: Mapping[str, int]) -> list[str]:
    """What is wrong with the audit log after a crash, given what the dead process reported (empty: nothing).

    admitted and released name requests by their callers' ids (unique within one run); the log's rows, keyed by
    audit keys, are matched to them through requests.caller_request_id."""
    problems: list[str] = []
    with AuditStore(url) as store:
        with store.engine.connect() as conn:
            caller = func.coalesce(REQUESTS.c.caller_request_id, REQUESTS.c.request_id)
            callers = dict(conn.execute(select(REQUESTS.c.request_id, caller)).all())
            wanted = {
                rid: params.get("n", 1) for rid, params in conn.execute(select(caller, REQUESTS.c.sampling_params))
            }
            rows = Counter(callers.get(key, key) for (key,) in conn.execute(select(COMPLETIONS.c.request_id)))
            ends = [
                (kind, callers.get(key, key))
                for kind, key in conn.execute(
                    select(EVENTS.c.kind, EVENTS.c.request_id).where(EVENTS.c.kind.in_(END_KINDS))
                )
            ]
        chain = store.first_break()
    ended = Counter(rid for _, rid in ends)
    with_rows = {rid for kind, rid in ends if kind in WITH_COMPLETIONS}
    finished = {rid for kind, rid in ends if kind == EventKind.REQUEST_FINISHED}
    for rid in sorted(admitted - wanted.keys()):
        problems.append(f"{rid}: admitted (add_request returned) but has no requests row")
    for rid, n in sorted(released.items()):
        if rows[rid] != n or rid not in finished:
            problems.append(
                f"{rid}: released with {n} completion(s) but the log has {rows[rid]} row(s), finished event: {rid in finished}"
            )
    for rid in sorted(rows.keys() - with_rows):
        problems.append(f"{rid}: {rows[rid]} completions row(s) but no finished/aborted event (a partial write)")
    for rid in sorted(with_rows - rows.keys()):
        problems.append(f"{rid}: a finished/aborted event but no completions rows (a partial write)")
    for rid, count in sorted(rows.items()):
        if count != wanted.get(rid):
            problems.append(f"{rid}: {count} completions rows for n={wanted.get(rid)}")
    for rid, count in sorted(ended.items()):
        if count > 1:
            problems.append(f"{rid}: {count} end events (one expected)")
    if chain is not None:
        problems.append(f"the event hash chain breaks at seq {chain.seq}: {chain.reason}")
    return problems


def restart_problems(url: str, model_dir: str | Path) -> tuple[list[str], list[str]]:
    """Start (and stop) an engine on the crashed database; (what is wrong with its recovery, the ids it recorded as interrupted)."""
    from loraledger import EngineArgs, LLMEngine

    with AuditStore(url) as store:
        with store.engine.connect() as conn:  # worked out here, not with the store's own query under test
            bound = set(conn.execute(select(REQUESTS.c.request_id)).scalars())
            ended = set(
                conn.execute(
                    select(EVENTS.c.request_id).where(EVENTS.c.kind.in_((*END_KINDS, EventKind.REQUEST_INTERRUPTED)))
                ).scalars()
            )
        unfinished = bound - ended
        since = store.head().sequence
    engine = LLMEngine(EngineArgs(model=str(model_dir), block_size=4, audit_url=url))
    try:
        interrupted = list(engine.engine.interrupted)
    finally:
        engine.close()
    with AuditStore(url) as store:
        with store.engine.connect() as conn:
            new = list(
                conn.execute(select(EVENTS.c.kind, EVENTS.c.request_id, EVENTS.c.payload).where(EVENTS.c.seq > since))
            )
        left = store.unfinished_requests()
        chain = store.first_break()
    problems: list[str] = []
    marked = Counter(rid for kind, rid, _ in new if kind == EventKind.REQUEST_INTERRUPTED)
    recovered = [payload for kind, _, payload in new if kind == EventKind.ENGINE_RECOVERED]
    if set(interrupted) != unfinished or len(interrupted) != len(unfinished):
        problems.append(
            f"engine.interrupted is {sorted(interrupted)}, the unfinished requests were {sorted(unfinished)}"
        )
    if set(marked) != unfinished or any(c != 1 for c in marked.values()):
        problems.append(f"request_interrupted events for {dict(marked)}, expected one each for {sorted(unfinished)}")
    if unfinished and (len(recovered) != 1 or set(recovered[0].get("interrupted", ())) != unfinished):
        problems.append(f"engine_recovered events {recovered}, expected one naming {sorted(unfinished)}")
    if not unfinished and any(p.get("interrupted") or not p.get("instances") for p in recovered):
        # an engine_recovered that only claims the dead instance (its lease, with nothing left to record) is fine
        problems.append(f"engine_recovered written although nothing was unfinished: {recovered}")
    if left:
        problems.append(f"still unfinished after recovery: {[r.request_id for r in left]}")
    if chain is not None:
        problems.append(f"after recovery the event hash chain breaks at seq {chain.seq}: {chain.reason}")
    return problems, interrupted
