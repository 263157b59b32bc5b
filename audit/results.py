"""Typed results of audit queries, verification and report export (frozen msgspec Structs)."""

from __future__ import annotations

import msgspec

from loraledger.store.records import AdapterRecord, Checkpoint, CompletionRecord, RequestRecord

# A request's status is the kind of its latest lifecycle event, shortened.
FINISHED, ABORTED, FAILED, INTERRUPTED, PENDING = "finished", "aborted", "failed", "interrupted", "pending"


class EventEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One row of the events table."""

    sequence: int
    kind: str
    at: float
    request_id: str | None
    payload: dict
    prev_hash: str
    hash: str


class RequestLineage(msgspec.Struct, frozen=True, kw_only=True):
    """Everything on record about one request: binding -> adapter -> completions, and its events in order."""

    binding: RequestRecord
    adapter: AdapterRecord | None  # None: the base model
    completions: list[CompletionRecord]
    events: list[EventEntry]
    status: str  # FINISHED | ABORTED | FAILED | INTERRUPTED | PENDING
    instance_id: str | None = None  # the engine instance that admitted it (None: written before instances existed)
    # where that instance's base model and tokenizer came from (the `instances` source columns; None: no instance)
    model_source: dict | None = None
    # the `erased` event that removed its prompt and completion text (None: not erased); the records then hold
    # prompt_text None and text "" beside their commitments
    erased_seq: int | None = None


class RequestRow(msgspec.Struct, frozen=True, kw_only=True):
    """One line of a request listing."""

    request_id: str  # the audit key
    received_at: float
    tenant: str | None
    adapter_fingerprint: str | None
    lora_name: str | None
    lora_int_id: int | None
    prompt_token_count: int
    num_completions: int
    generated_tokens: int
    finish_reasons: str | None  # the distinct finish reasons of its completions, sorted, comma-separated
    status: str
    finished_at: float | None
    caller_request_id: str | None = None  # the caller's own id (NULL on rows from before revision 0006: request_id)
    instance_id: str | None = None  # the engine instance that admitted it (None: written before instances existed)


class UsageRow(msgspec.Struct, frozen=True, kw_only=True):
    """Usage of one group; the fields not grouped by are None."""

    adapter_fingerprint: str | None
    lora_name: str | None  # the adapter's registered name (None for the base model)
    tenant: str | None
    day: str | None  # YYYY-MM-DD, UTC
    requests: int
    prompt_tokens: int
    generated_tokens: int
    errors: int  # requests that ended in request_failed


class AdapterInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One adapter of the inventory, with its use."""

    record: AdapterRecord
    requests: int
    first_used: float | None
    last_used: float | None


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    sequence: int | None  # the first event sequence number concerned, when there is one
    message: str
    request_id: str | None = None
    table: str | None = None  # the audit table whose row is wrong: adapters, requests, completions or events
    key: dict | None = None  # that row's key, column -> value (for completions, request_id alone: all its rows)


class VerifyResult(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    head: Checkpoint | None  # None: the log has no events
    events: int  # rows checked
    requests: int
    completions: int
    problems: list[Problem]  # sorted by sequence number; at most VerifyResult.MAX_PROBLEMS kept
    problem_count: int  # all problems found, kept or not
    erased_texts: int = 0  # prompt and completion text rows that `audit erase` removed, each on record

    MAX_PROBLEMS = 100

    @property
    def first_problem(self) -> Problem | None:
        return self.problems[0] if self.problems else None


class ExportedFile(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    rows: int | None  # None: not a row file (report.html)
    bytes: int
    sha256: str


class ReportCheck(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of verify-report."""

    ok: bool
    problems: list[str]
    signature: str  # the algorithm the manifest names
