"""The audit records the engine hands to the store: the contract between actors and store/.

The AuditWriter actor batches these and calls AuditStore.write(batch) once per group commit.
Every write is idempotent: rows are keyed (adapter fingerprint, request id, (request id, index),
event dedup_key), so a retry after an ambiguous failure leaves exactly one record.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from loraledger.digests import new_text_salt, text_commitment, token_ids_commitment


def recordable(text: str | None) -> str | None:
    """Text as the audit log keeps it: NUL (which PostgreSQL text cannot hold) becomes U+FFFD.

    Applied where records are made, on every dialect, so digests computed from the records match
    the rows; token_ids stay exact, so the original text can always be decoded from them.
    """
    return None if text is None else text.replace("\x00", "\ufffd")


class EventKind:
    ENGINE_STARTED = "engine_started"
    ENGINE_STOPPED = "engine_stopped"
    ENGINE_RECOVERED = "engine_recovered"  # payload: the requests recorded interrupted, the expired instances claimed
    REQUEST_ADMITTED = "request_admitted"  # payload: the binding
    REQUEST_PREEMPTED = "request_preempted"
    REQUEST_FINISHED = "request_finished"
    REQUEST_ABORTED = "request_aborted"
    REQUEST_FAILED = "request_failed"
    REQUEST_INTERRUPTED = "request_interrupted"  # found unfinished at start: the engine had died
    REQUEST_RESUMED = "request_resumed"
    RESUME_REFUSED = "resume_refused"  # the adapter's content changed since the binding
    ADAPTER_LOADED = "adapter_loaded"
    ADAPTER_EVICTED = "adapter_evicted"
    ADAPTER_FAILED = "adapter_failed"
    ADAPTER_REGISTERED = "adapter_registered"  # payload: the `adapters` row, written with it (store/registration.py)
    # the HTTP server refused a key a model it may not use; payload: tenant, key_id, adapter (the model asked for),
    # route; no request id and no binding (nothing was admitted)
    ACCESS_DENIED = "access_denied"
    # `audit erase` removed the text of some requests; payload: who, why, the selector, counts, requests_sha256
    ERASED = "erased"
    # an engine instance joined the database: payload the `instances` row, written with it (store/instances.py)
    INSTANCE_REGISTERED = "instance_registered"
    # an engine instance stopped cleanly (nothing left unfinished); written with its lease's stop marker, which verify
    # compares with it (store/instances.py); payload: instance_id
    INSTANCE_STOPPED = "instance_stopped"

    TERMINAL = frozenset({REQUEST_FINISHED, REQUEST_ABORTED, REQUEST_FAILED, REQUEST_INTERRUPTED})


class AdapterRecord(msgspec.Struct, frozen=True, kw_only=True):
    fingerprint: str  # sha256 hex of the canonical adapter config + tensor bytes
    name: str
    int_id: int
    path: str
    rank: int
    alpha: float
    target_modules: list[str]
    base_model_fingerprint: str
    use_rslora: bool = False
    first_seen: float = 0.0  # unix time
    # where the content first seen came from (revision 0009): a Hub repo id, the revision asked for and the commit sha
    # it resolved to; None for a local folder (a folder inside a Hub cache names its repo and commit)
    repo_id: str | None = None
    revision: str | None = None
    commit_sha: str | None = None


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The binding: request id <-> LoRARequest as submitted <-> adapter fingerprint. Never changes.

    request_id is the audit key the engine made (loraledger.audit_ids: a UUIDv7, unique forever); the caller's
    own id, which vLLM lets it reuse once the earlier request has finished, is caller_request_id.
    """

    request_id: str
    adapter_fingerprint: str | None  # None: the base model
    lora_name: str | None
    lora_int_id: int | None
    lora_path: str | None
    tenant: str | None
    sampling_params: dict  # msgspec.to_builtins(SamplingParams)
    prompt_text: str | None  # per audit_prompts: the text ("text"), None otherwise
    prompt_sha256: str | None  # sha256 hex of the prompt text (or of the token ids for token prompts); None for "none"
    prompt_token_count: int
    received_at: float
    engine_version: str
    base_model_fingerprint: str
    key_id: str | None = None  # the API key that authenticated the caller at the HTTP server (and gave the tenant)
    # revision 0006; bindings admitted before it carry neither key (read as None, so they verify as before)
    caller_request_id: str | None = None  # the caller's request id (RequestOutput.request_id)
    chat_template_sha256: str | None = (
        None  # LLM.chat / the chat route: sha256 hex of the template that rendered the prompt
    )
    # structured outputs: the constraint's kind (json, regex, choice, grammar, json_object), the sha256 of its canonical
    # JSON text, and that text itself where audit_prompts is "text"; None for unconstrained requests
    constraint_kind: str | None = None
    constraint_sha256: str | None = None
    constraint_text: str | None = None
    # the adapter's source for this request (revision 0009): Hub repo id, revision asked for, commit sha loaded;
    # None for the base model and for local folders (the same content may come from several commits)
    adapter_repo_id: str | None = None
    adapter_revision: str | None = None
    adapter_commit_sha: str | None = None
    # salted text (revision 0013): where the prompt is kept as text, it lives in `request_texts` under a random salt and
    # the binding carries sha256(salt || text) and sha256(salt || ids) instead (prompt_text stays None); None before
    prompt_commitment: str | None = None
    prompt_token_ids_commitment: str | None = None
    # tools (revision 0014): the sha256 of the request's tool definitions as canonical JSON, and that text where
    # audit_prompts is "text"; None for requests without tools
    tools_sha256: str | None = None
    tools_text: str | None = None
    # caller content apart (revision 0016): the tool definitions and the constraint's text go to `request_texts` under
    # salts like the prompt (tools_text / constraint_text stay None), the binding carrying sha256(salt || text);
    # tool_reading says how each completion's calls are read ({"mode", "parser", "parallel", "name_index"}: the
    # named function by its index in the tools), so a resumed request reads them as the first run did
    tools_commitment: str | None = None
    constraint_commitment: str | None = None
    tool_reading: dict | None = None


class CompletionRecord(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: str | None  # stop string, or the stop token id as a string
    adapter_fingerprint: str | None  # must equal the request's binding (the database checks it)
    prompt_token_count: int
    generated_token_count: int
    first_token_at: float | None
    finished_at: float
    # salted text (revision 0013): text "" and token_ids [] here, the real ones in `request_texts`; None before
    text_commitment: str | None = None
    token_ids_commitment: str | None = None
    tool_calls: str | None = None  # revision 0014: the calls read from `text` (canonical JSON); None for none
    # revision 0016: the calls in `request_texts` (part "tool_calls") under a salt, tool_calls None here; None for none
    tool_calls_commitment: str | None = None


class TextRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt's or completion's text and token ids, kept apart (`request_texts`) so `audit erase` can remove them.

    part: "prompt" (index 0) or "completion" (its index); from revision 0016 also "tools" and "constraint" (index 0,
    the binding's tool definitions and constraint text) and "tool_calls" (the completion's index), which hold text
    and no token ids; salt: 32 hex digits, the row's commitments' salt.
    """

    request_id: str
    part: str
    index: int
    salt: str
    text: str | None
    token_ids: list[int]


PROMPT, COMPLETION = "prompt", "completion"  # TextRecord.part
# caller content beside the prompt (revision 0016): text only (token_ids []), one commitment each
TOOLS, CONSTRAINT, TOOL_CALLS = "tools", "constraint", "tool_calls"


def salted_text(request_id: str, part: str, index: int, text: str | None, token_ids: Sequence[int]) -> TextRecord:
    """A text record under a fresh salt."""
    return TextRecord(
        request_id=request_id, part=part, index=index, salt=new_text_salt(), text=text, token_ids=list(token_ids)
    )


def salted_content(request_id: str, part: str, index: int, text: str) -> tuple[TextRecord, str]:
    """Caller content with no token ids (tools, constraint, tool_calls) under a fresh salt, and its commitment."""
    record = salted_text(request_id, part, index, text, [])
    return record, text_commitment(record.salt, text)


def text_commitments(record: TextRecord) -> tuple[str | None, str]:
    """(sha256(salt || text) or None where there is no text, sha256(salt || ids)) of a text record."""
    text = None if record.text is None else text_commitment(record.salt, record.text)
    return text, token_ids_commitment(record.salt, record.token_ids)


class EventRecord(msgspec.Struct, frozen=True, kw_only=True):
    kind: str  # an EventKind value
    at: float  # unix time
    request_id: str | None = None
    payload: dict = {}
    dedup_key: str | None = None  # e.g. "finished:<request id>"; a second event with the same key is skipped


class AuditBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one group commit writes, in one transaction, in this order."""

    adapters: list[AdapterRecord] = []
    requests: list[RequestRecord] = []
    completions: list[CompletionRecord] = []
    events: list[EventRecord] = []
    texts: list[TextRecord] = []  # the salted text of the requests and completions above


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    """The head of the event hash chain: enough to prove later that the log only grew."""

    sequence: int
    hash: str
    at: float
