"""Audit log verification: the hash chain, sequence gaps, and every row of every table against the event that vouches for it.

One ordered pass over `events` (one chain, whatever the number of engine instances that wrote it;
audit/chain_walk.py): each request_admitted event is joined to its `requests` row (whose instance_id must be the
event's), each adapter_registered and instance_registered event looks up its `adapters` or `instances` row, and the
completions of finished and aborted requests come from a second cursor read alongside (merged by sequence number),
their digest computed as they stream (audit/event_rows.py). Then a few queries find rows that no event vouches for
(audit/unvouched.py). One event and one completion row are held at a time, so memory stays flat whatever the log's
size (a request with n completions included). Rows are read untyped and decoded column by column
(audit/raw_rows.py): a malformed value is a problem reported at its row, never an exception. Every digest checked
is the one loraledger.digests defines (DIGESTS.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec
from sqlalchemy import Connection, func, select

from loraledger.audit import text_checks, unvouched
from loraledger.audit.chain_walk import ChainWalk
from loraledger.audit.event_rows import EventRows, Tables, ending_completions_query, events_query
from loraledger.audit.problems import Problems
from loraledger.audit.queries import C, R, stream
from loraledger.audit.results import VerifyResult
from loraledger.audit.row_stream import RowStream
from loraledger.audit.schema_objects import check_schema_objects
from loraledger.errors import ConfigError
from loraledger.evidence import tree_verify
from loraledger.store.records import Checkpoint


def verify_log(
    conn: Connection, checkpoint: Checkpoint | None = None, *, on_event: Callable[[], None] | None = None
) -> VerifyResult:
    """Check the whole log; problems are reported at the first event sequence number they concern.

    checkpoint: a head from an earlier export that the log must still contain unchanged.
    on_event: called once per event checked (progress display).
    """
    tables = Tables(conn.dialect)
    found = Problems()
    completions = stream(conn, ending_completions_query(tables))
    rows = EventRows(conn, tables, found, RowStream(completions))
    walk = ChainWalk(tables, found, checkpoint, rows)
    try:
        for row in stream(conn, events_query(tables)):
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
    unvouched.check_unbound(conn, found)
    unvouched.check_unregistered(conn, found)
    unvouched.check_unregistered_instances(conn, found)
    unvouched.check_unclaimed_recoveries(conn, rows.claims, found)
    unvouched.check_stop_markers(conn, found)
    unvouched.check_unvouched_completions(conn, found)
    unvouched.check_completion_adapters(conn, found)
    erased = text_checks.check_texts(conn, found)  # salted text against its commitments, or erased on record
    text_checks.check_erasures(conn, found)
    tree_verify.check_all(conn, found.add)  # the Merkle tree, signed checkpoints and receipts (loraledger/evidence/)
    check_schema_objects(conn, found.add)  # the views are as the migrations made them
    n_requests = conn.execute(select(func.count()).select_from(R)).scalar_one()
    n_completions = conn.execute(select(func.count()).select_from(C)).scalar_one()
    return VerifyResult(
        ok=found.count == 0,
        head=walk.head,
        events=walk.events,
        requests=int(n_requests),
        completions=int(n_completions),
        erased_texts=erased,
        problems=found.sorted(),
        problem_count=found.count,
    )


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
