"""A log the engine wrote, kept as data: its stored hashes recompute, in the database and by the spec alone.

engine_log.json is the content of a real SQLite audit log (an engine with two adapters serving five requests:
n=3 sampling, a token-id prompt, a stop string, a JSON constraint and a chat template; audit_prompts="text"),
exported table by table, times as their ISO text. Its hashes are fixed: a change to any digest's bytes fails
here as well as in DIGESTS.md's vectors, and loaded into a migrated database the log still verifies.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
from sqlalchemy import insert

from loraledger import digests
from loraledger.audit.typed_rows import binding_builtins
from loraledger.audit.verify import verify_log
from loraledger.evidence.node_store import backfill
from loraledger.store.db import make_engine
from loraledger.store.models import Base
from loraledger.store.records import CompletionRecord, EventKind
from tests.digests import spec_verifier as spec

LOG = json.loads((Path(__file__).parent / "engine_log.json").read_text(encoding="utf-8"))
TIMES = {
    "events": ("at",),
    "requests": ("received_at",),
    "completions": ("first_token_at", "finished_at"),
    "adapters": ("first_seen",),
    "instances": ("started_at",),
}


def _when(text: str | None) -> dt.datetime | None:
    return None if text is None else dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _unix(text: str | None) -> float | None:
    when = _when(text)
    return None if when is None else when.timestamp()


def _rows(table: str) -> list[dict[str, Any]]:
    """The table's rows with their times as aware datetimes, as the store reads them back."""
    out = []
    for row in LOG[table]:
        row = {**row, **{k: _when(row[k]) for k in TIMES[table]}}
        if table == "adapters":
            row["use_rslora"] = bool(row["use_rslora"])
        out.append(row)
    return out


def _completions(request_id: str) -> list[CompletionRecord]:
    records = []
    for row in LOG["completions"]:
        if row["request_id"] == request_id:
            fields = {**row, "index": row["completion_index"], "first_token_at": _unix(row["first_token_at"])}
            fields["finished_at"] = _unix(row["finished_at"])
            del fields["completion_index"]
            records.append(msgspec.convert(fields, CompletionRecord))
    return records


def test_the_log_covers_every_digest_it_should():
    kinds = {e["kind"] for e in LOG["events"]}
    assert {"request_admitted", "request_finished", "adapter_registered", "instance_registered"} <= kinds
    bindings = [e["payload"]["binding"] for e in LOG["events"] if e["kind"] == EventKind.REQUEST_ADMITTED]
    assert any(b["constraint_sha256"] for b in bindings) and any(b["chat_template_sha256"] for b in bindings)
    assert any(c["completion_index"] == 2 for c in LOG["completions"])  # n > 1


def test_the_chain_recomputes():
    rows = [SimpleNamespace(**row) for row in _rows("events")]
    assert digests.first_break(rows) is None
    prev = digests.GENESIS_HASH
    for event in LOG["events"]:  # the spec's verifier takes `at` as its canonical text, as exported
        assert event["prev_hash"] == prev and spec.event_hash(prev, event) == event["hash"]
        prev = event["hash"]


def test_every_payload_digest_recomputes():
    requests = {r["request_id"]: r for r in LOG["requests"]}
    for event in LOG["events"]:
        kind, payload = event["kind"], event["payload"]
        if kind == EventKind.REQUEST_ADMITTED:
            binding = payload["binding"]
            assert digests.binding_digest(binding) == spec.digest(binding) == payload["binding_sha256"]
            row = {**requests[event["request_id"]], "received_at": _unix(requests[event["request_id"]]["received_at"])}
            assert {**binding_builtins(binding), "instance_id": event["instance_id"]} == row
            if binding["prompt_text"] is not None:
                prompt = binding["prompt_text"].encode("utf-8")
            else:  # a prompt given as token ids: the payload keeps them
                prompt = spec.cj_text(payload["prompt_token_ids"]).encode("ascii")
            assert spec.sha256(prompt) == binding["prompt_sha256"]
            if binding["constraint_text"] is not None:
                assert spec.sha256(binding["constraint_text"].encode("utf-8")) == binding["constraint_sha256"]
        elif kind == EventKind.REQUEST_FINISHED:
            records = _completions(event["request_id"])
            # as DIGESTS.md section 4 builds each object: tool_calls only where the column holds calls
            plain = [
                {k: v for k, v in msgspec.to_builtins(r).items() if k != "tool_calls" or v is not None} for r in records
            ]
            assert len(records) == payload["num_completions"]
            assert (
                digests.completions_digest(records) == spec.completions_sha256(plain) == payload["completions_sha256"]
            )
        elif kind == EventKind.ADAPTER_REGISTERED:
            assert digests.registration_digest(payload["adapter"]) == spec.digest(payload["adapter"])
            assert spec.digest(payload["adapter"]) == payload["adapter_sha256"]
        elif kind == EventKind.INSTANCE_REGISTERED:
            assert spec.digest(payload["instance"]) == payload["instance_sha256"]


def test_loaded_into_a_database_the_log_verifies(migrated_db_url):
    """On both dialects: rows inserted as read (the guards allow INSERT), then `audit verify`."""
    engine = make_engine(migrated_db_url)
    try:
        with engine.begin() as conn:
            for table in ("instances", "adapters", "requests", "completions", "events"):
                conn.execute(insert(Base.metadata.tables[table]), _rows(table))
            backfill(conn)  # the Merkle tree over those events, as the writer (and revision 0009) builds it
        with engine.connect() as conn:
            result = verify_log(conn)
    finally:
        engine.dispose()
    assert result.ok, result.problems
    assert (result.events, result.requests, result.completions) == (17, 5, 7)
    assert result.head is not None and result.head.hash == LOG["events"][-1]["hash"]
