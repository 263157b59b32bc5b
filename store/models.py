"""The audit schema as SQLAlchemy 2 typed ORM classes: adapters, requests, completions, events, instances (and instance_leases).

The table and column names are a public contract: auditors query them with plain SQL. The
schema itself is made only by the Alembic revisions in `loraledger.migrations` (never
`create_all`); these classes describe it for queries and for `alembic check`, which proves the
two agree. The append-only guards (triggers) live in `loraledger.store.guards`.

Times are timezone-aware UTC timestamps with microseconds: `timestamp with time zone` on
PostgreSQL; on SQLite the text `YYYY-MM-DD HH:MM:SS.ffffff+00:00`, which SQLite's own date
functions understand and which sorts chronologically.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeEngine

from loraledger.digests import stored_datetime

# Fixed before the first revision: constraint names are part of the schema, and a later change
# of convention would make every existing database drift from the models.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s__%(column_0_N_name)s",
    "uq": "uq_%(table_name)s__%(column_0_N_name)s",
    "ck": "ck_%(table_name)s__%(constraint_name)s",
    "fk": "fk_%(table_name)s__%(column_0_N_name)s__%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

AUDIT_TABLES = (
    "adapters",
    "requests",
    "completions",
    "events",
    "instances",
    "merkle_nodes",
    "checkpoints",
    "receipts",
    "request_texts",
    "erasures",
)
# audit tables whose rows `audit erase` may delete, through the guarded path (store/guards.py, audit/erase.py)
ERASABLE_TABLES = ("request_texts",)
# coordination state, not audit facts: rows change (a lease is renewed), so no guard and no hash covers them;
# what they decide (which instance recovered which) is put on the chain as events
COORDINATION_TABLES = ("instance_leases",)

_SQLITE_UTC_FORMAT = "%(year)04d-%(month)02d-%(day)02d %(hour)02d:%(minute)02d:%(second)02d.%(microsecond)06d+00:00"
_SQLITE_UTC_REGEXP = r"(\d{4})-(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d{6})\+00:00"


def utc_from_unix(seconds: float) -> dt.datetime:
    """A record's unix time as an aware UTC datetime, rounded to the microsecond (the rounding digests define)."""
    return stored_datetime(seconds)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """An aware UTC datetime on both dialects; naive datetimes are refused rather than guessed."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "sqlite":
            # the explicit +00:00 keeps the stored text unambiguous for people reading it with SQL
            return dialect.type_descriptor(
                sqlite.DATETIME(storage_format=_SQLITE_UTC_FORMAT, regexp=_SQLITE_UTC_REGEXP)
            )
        return dialect.type_descriptor(DateTime(timezone=True))

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: audit times must be timezone-aware")
        value = value.astimezone(dt.timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        dt.datetime: UTCDateTime(),
        float: Double(),
        str: Text(),
        dict[str, Any]: JSON(),
        list[str]: JSON(),
        list[int]: JSON(),
    }


Sha256 = String(64)


class Adapter(Base):
    """`adapters`: one row per distinct adapter content, keyed by its fingerprint.

    Columns: `fingerprint` (PK, sha256 hex of the canonical adapter config and tensor bytes),
    `name` and `int_id` (as first seen), `path` (as first seen), `rank`, `alpha`,
    `target_modules` (JSON list of module names), `base_model_fingerprint`, `use_rslora`,
    `first_seen` (UTC), and where that content came from (revision 0009): `repo_id` (the Hugging Face Hub repo;
    NULL for a local folder), `revision` (the branch, tag or sha asked for, "main" when none was) and `commit_sha`
    (the commit the files were read from; also set for a local folder that is a Hub cache snapshot). The same content loaded later under another name keeps the first row;
    the name a request used is in `requests.lora_name`.
    """

    __tablename__ = "adapters"

    fingerprint: Mapped[str] = mapped_column(Sha256, primary_key=True)
    name: Mapped[str]
    int_id: Mapped[int]
    path: Mapped[str]
    rank: Mapped[int]
    alpha: Mapped[float]
    target_modules: Mapped[list[str]]
    base_model_fingerprint: Mapped[str] = mapped_column(Sha256)
    use_rslora: Mapped[bool]
    first_seen: Mapped[dt.datetime]
    repo_id: Mapped[str | None]
    revision: Mapped[str | None]
    commit_sha: Mapped[str | None] = mapped_column(String(40))

    requests: Mapped[list[Request]] = relationship(back_populates="adapter", lazy="raise")


class Request(Base):
    """`requests`: the binding, one row per request id, written at admission and never changed.

    Columns: `request_id` (PK), `adapter_fingerprint` (FK -> adapters; NULL for the base model),
    `lora_name` / `lora_int_id` / `lora_path` (the LoRARequest as submitted; NULL for the base
    model), `tenant` (NULL if none), `sampling_params` (JSON), `prompt_text` (NULL unless prompts
    are audited as text), `prompt_sha256` (NULL when prompts are not audited),
    `prompt_token_count`, `received_at` (UTC), `engine_version`, `base_model_fingerprint`, `key_id` (the id
    of the API key that authenticated the request at the HTTP server, which also set `tenant`; NULL for
    requests submitted in-process or to a server without keys; revision 0005), `caller_request_id` (the caller's
    own request id, which it may reuse once the earlier request has finished; `request_id` is the audit key the
    engine made, a UUIDv7) and `chat_template_sha256` (sha256 hex of the chat template that rendered a chat
    request's prompt; NULL for other requests), both revision 0006. Rows written before 0006 hold NULL in both:
    their `request_id` was the caller's id too. `constraint_kind` / `constraint_sha256` / `constraint_text`
    (structured outputs: the constraint's kind, the sha256 of its canonical JSON text, and that text where
    prompts are audited as text; NULL for unconstrained requests; revision 0008), `instance_id` (the engine
    instance that admitted it, see `instances`; NULL for rows written before revision 0007).
    `adapter_repo_id` / `adapter_revision` / `adapter_commit_sha` (revision 0009): the Hub repo, the revision asked
    for and the commit the request's adapter was read from (NULL for the base model and local folders).
    `tools_commitment` / `constraint_commitment` (revision 0016): sha256(salt || text) of the tool definitions and
    of the constraint's text, kept in `request_texts` (parts "tools", "constraint"; `tools_text` / `constraint_text`
    NULL here), and `tool_reading` (JSON: how the completions' calls are read: mode, parser, parallel, name_index).
    """

    __tablename__ = "requests"
    __table_args__ = (
        Index(None, "adapter_fingerprint", "received_at"),
        Index(None, "tenant", "received_at"),
        Index(None, "received_at"),
        Index(None, "caller_request_id"),
        Index(None, "instance_id", "received_at"),
    )

    request_id: Mapped[str] = mapped_column(primary_key=True)
    adapter_fingerprint: Mapped[str | None] = mapped_column(Sha256, ForeignKey("adapters.fingerprint"))
    lora_name: Mapped[str | None]
    lora_int_id: Mapped[int | None]
    lora_path: Mapped[str | None]
    tenant: Mapped[str | None]
    sampling_params: Mapped[dict[str, Any]]
    prompt_text: Mapped[str | None]
    prompt_sha256: Mapped[str | None] = mapped_column(Sha256)
    prompt_token_count: Mapped[int]
    received_at: Mapped[dt.datetime]
    engine_version: Mapped[str]
    base_model_fingerprint: Mapped[str] = mapped_column(Sha256)
    key_id: Mapped[str | None]
    caller_request_id: Mapped[str | None]
    chat_template_sha256: Mapped[str | None] = mapped_column(Sha256)
    constraint_kind: Mapped[str | None]
    constraint_sha256: Mapped[str | None] = mapped_column(Sha256)
    constraint_text: Mapped[str | None]
    instance_id: Mapped[str | None]
    adapter_repo_id: Mapped[str | None]
    adapter_revision: Mapped[str | None]
    adapter_commit_sha: Mapped[str | None] = mapped_column(String(40))
    prompt_commitment: Mapped[str | None] = mapped_column(Sha256)
    prompt_token_ids_commitment: Mapped[str | None] = mapped_column(Sha256)
    tools_sha256: Mapped[str | None] = mapped_column(Sha256)
    tools_text: Mapped[str | None]
    tools_commitment: Mapped[str | None] = mapped_column(Sha256)
    constraint_commitment: Mapped[str | None] = mapped_column(Sha256)
    tool_reading: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))

    adapter: Mapped[Adapter | None] = relationship(back_populates="requests", lazy="raise")
    completions: Mapped[list[Completion]] = relationship(back_populates="request", lazy="raise")


class Completion(Base):
    """`completions`: one row per CompletionOutput, keyed by (`request_id`, `completion_index`).

    `completion_index` is vLLM's `CompletionOutput.index` (named so because INDEX is an SQL
    keyword). Other columns: `text`, `token_ids` (JSON list of ints), `cumulative_logprob`
    (NULL if not computed), `finish_reason` ("stop" | "length" | "abort"), `stop_reason` (the
    stop string or stop token id as text; NULL if none), `adapter_fingerprint` (repeated from
    the request; a database trigger refuses a row where it differs from the request's binding),
    `prompt_token_count`, `generated_token_count`, `first_token_at` (UTC, NULL if no token was
    generated), `finished_at` (UTC). `text_commitment` / `token_ids_commitment` (revision 0013): the completion's
    text and token ids live in `request_texts`, `text` is "" and `token_ids` [] here, and these hold sha256(salt ||
    text) and sha256(salt || ids); NULL for rows written before 0013, which keep their text here. `tool_calls`
    (revision 0014: the calls read from the text for a request with tools, canonical JSON `[{"name",
    "arguments"}]`; NULL without a call). `tool_calls_commitment` (revision 0016): those calls kept in `request_texts`
    (part "tool_calls", idx the completion index) under a salt, sha256(salt || text) here and `tool_calls` NULL.
    """

    __tablename__ = "completions"
    __table_args__ = (
        Index(None, "finish_reason"),
        Index(None, "adapter_fingerprint"),
    )

    request_id: Mapped[str] = mapped_column(ForeignKey("requests.request_id"), primary_key=True)
    completion_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    text: Mapped[str]
    token_ids: Mapped[list[int]]
    cumulative_logprob: Mapped[float | None]
    finish_reason: Mapped[str]
    stop_reason: Mapped[str | None]
    adapter_fingerprint: Mapped[str | None] = mapped_column(Sha256)
    prompt_token_count: Mapped[int]
    generated_token_count: Mapped[int]
    first_token_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime]
    text_commitment: Mapped[str | None] = mapped_column(Sha256)
    token_ids_commitment: Mapped[str | None] = mapped_column(Sha256)
    tool_calls: Mapped[str | None]
    tool_calls_commitment: Mapped[str | None] = mapped_column(Sha256)

    request: Mapped[Request] = relationship(back_populates="completions", lazy="raise")


class Event(Base):
    """`events`: the hash-chained event log, in `seq` order (1, 2, 3, ... with no gaps).

    Columns: `seq` (PK, assigned by the writer), `at` (UTC), `kind` (an EventKind value),
    `request_id` (NULL for engine-wide events; no foreign key, because a request refused at
    admission has events but no binding), `payload` (JSON), `dedup_key` (UNIQUE, NULL-able: a
    second event with the same key is never written), `prev_hash` (the previous row's `hash`;
    64 zeros for seq 1) and `hash` = sha256(prev_hash || canonical JSON of [seq, at, kind,
    request_id, payload, dedup_key]), see `loraledger.digests` and DIGESTS.md; `instance_id` (the engine instance
    that wrote the event; NULL for events written by tools and before revision 0007; when set, it is hashed too).
    """

    __tablename__ = "events"
    __table_args__ = (
        UniqueConstraint("dedup_key"),
        Index(None, "request_id", "kind"),
        Index(None, "kind"),
    )

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    at: Mapped[dt.datetime]
    kind: Mapped[str]
    request_id: Mapped[str | None]
    payload: Mapped[dict[str, Any]]
    dedup_key: Mapped[str | None]
    prev_hash: Mapped[str] = mapped_column(Sha256)
    hash: Mapped[str] = mapped_column(Sha256)
    instance_id: Mapped[str | None]


class Instance(Base):
    """`instances`: one row per engine start (revision 0007), written once and vouched for by its
    instance_registered event.

    Columns: `instance_id` (PK, made by the engine, unique forever), `host`, `pid`, `engine_version`,
    `started_at` (UTC), `lease_seconds` (how long the instance's lease lasts without a renewal); revision 0009:
    `model` / `tokenizer` (as given: a folder or a Hub repo id), and for each the Hub repo, the revision asked for
    and the commit sha read (`model_repo_id`, `model_revision`, `model_commit_sha`, and the same for the tokenizer;
    NULL for a local folder, and for engines that had no tokenizer or started before 0009); revision 0015: how the
    base model's weights are quantized as served (`quantization`: a readable description such as "gptq 4-bit g128
    asym"; `quant_method`, `quant_bits`, `quant_group_size`, NULL for a per-channel scale; `quant_source_fingerprint`,
    for a float checkpoint the engine quantized at load, that checkpoint's own fingerprint), all NULL for float
    weights and engines that started before 0015.
    """

    __tablename__ = "instances"

    instance_id: Mapped[str] = mapped_column(primary_key=True)
    host: Mapped[str]
    pid: Mapped[int]
    engine_version: Mapped[str]
    started_at: Mapped[dt.datetime]
    lease_seconds: Mapped[float]
    model: Mapped[str | None]
    model_repo_id: Mapped[str | None]
    model_revision: Mapped[str | None]
    model_commit_sha: Mapped[str | None] = mapped_column(String(40))
    tokenizer: Mapped[str | None]
    tokenizer_repo_id: Mapped[str | None]
    tokenizer_revision: Mapped[str | None]
    tokenizer_commit_sha: Mapped[str | None] = mapped_column(String(40))
    quantization: Mapped[str | None]
    quant_method: Mapped[str | None]
    quant_bits: Mapped[int | None]
    quant_group_size: Mapped[int | None]
    quant_source_fingerprint: Mapped[str | None] = mapped_column(Sha256)


class InstanceLease(Base):
    """`instance_leases`: the lease each instance renews while it runs (coordination state, updated in place).

    Columns: `instance_id` (PK), `expires_at` (UTC, by the database's clock), `process_key` (which process
    on which machine holds it, see store/process_identity.py; NULL where that cannot be told),
    `recovered_by` (the instance that recorded this one's unfinished requests as interrupted once its lease
    had expired, or the instance itself when it stopped cleanly; NULL while it runs), `recovered_at` (UTC).
    An instance whose lease was recovered writes nothing more.
    """

    __tablename__ = "instance_leases"

    instance_id: Mapped[str] = mapped_column(ForeignKey("instances.instance_id"), primary_key=True)
    expires_at: Mapped[dt.datetime]
    process_key: Mapped[str | None]
    recovered_by: Mapped[str | None]
    recovered_at: Mapped[dt.datetime | None]


class MerkleNode(Base):
    """`merkle_nodes`: the RFC 9162 Merkle tree over the events (revision 0009), one row per complete subtree.

    Leaf `idx` (level 0) is the event with seq idx + 1, its hash SHA-256(0x00 || the event's `hash` as 32 bytes);
    the node at (`level`, `idx`) covers leaves [idx * 2^level, (idx + 1) * 2^level) and is SHA-256(0x01 || left ||
    right). Written with the events in the same transaction, so the tree always has one leaf per event; signed
    checkpoints and proofs are read from it (loraledger/evidence/, EVIDENCE.md).
    """

    __tablename__ = "merkle_nodes"

    level: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    idx: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    hash: Mapped[str] = mapped_column(Sha256)


class SignedCheckpoint(Base):
    """`checkpoints`: checkpoints the log signed (revision 0010), one per tree size, in the C2SP signed-note format.

    Columns: `tree_size` (PK), `note` (the signed note: origin, tree size, base64 root hash, then the log's
    signature line), `log_key` (the log's verifier key, a vkey). Witnesses that read the database cosign the latest.
    """

    __tablename__ = "checkpoints"

    tree_size: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    note: Mapped[str]
    log_key: Mapped[str]


class Receipt(Base):
    """`receipts`: the signed receipt of each finished request (revision 0010), as its caller received it.

    Columns: `request_id` (PK, the audit key), `seq` (its request_finished event; leaf seq - 1 of the tree),
    `body` (the canonical JSON the signature covers, see loraledger/evidence/receipt.py), `signature` (base64
    Ed25519), `log_key` (the log's verifier key, a vkey).
    """

    __tablename__ = "receipts"

    request_id: Mapped[str] = mapped_column(primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    body: Mapped[str]
    signature: Mapped[str]
    log_key: Mapped[str]


class RequestText(Base):
    """`request_texts`: the text and token ids of a prompt or completion, apart so that `audit erase` can remove them
    (revision 0013). The only audit rows that may be deleted, and only by an erasure on record (store/guards.py).

    Columns: `request_id`, `part` ("prompt" or "completion"; from revision 0016 also "tools", "constraint" and
    "tool_calls", text with `token_ids` []), `idx` (0 for the prompt, tools, constraint, else the completion index),
    `salt` (32 hex digits, random per row), `text` (NULL for a prompt given as token ids), `token_ids` (JSON list).
    The requests / completions row holds the commitments sha256(salt || text) and sha256(salt || ids).
    """

    __tablename__ = "request_texts"

    request_id: Mapped[str] = mapped_column(primary_key=True)
    part: Mapped[str] = mapped_column(primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    salt: Mapped[str]
    text: Mapped[str | None]
    token_ids: Mapped[list[int]]


class Erasure(Base):
    """`erasures`: one row per request whose text `audit erase` removed (revision 0013), naming its `erased` event.

    Columns: `request_id` (PK), `seq` (the `erased` event, whose payload counts these rows and digests their keys).
    A `request_texts` row can be deleted only when its request has a row here naming an `erased` event.
    """

    __tablename__ = "erasures"
    __table_args__ = (Index(None, "seq"),)

    request_id: Mapped[str] = mapped_column(primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)
