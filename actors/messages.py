"""Every message the actors exchange: frozen, tagged msgspec Structs (array_like on the hot path).

Request/response pairs carry a `reply` field holding a one-shot anyio send stream (the reply
channel); everything else is fire-and-forget into the receiving actor's inbox. Exceptions and
host-side objects (adapter checkpoints, reply channels) travel as `object` fields: these messages
never leave the process, so msgspec is used for its cheap, frozen, typed structs, not for bytes.
New fields get defaults and are appended, never reordered.
"""

from __future__ import annotations

import msgspec

from loraledger.lora.request import LoRARequest
from loraledger.sampling_params import SamplingParams
from loraledger.scheduling.step_plan import StepOutput, StepPlan
from loraledger.store.records import AdapterRecord, CompletionRecord, EventRecord, RequestRecord, TextRecord


class Msg(msgspec.Struct, frozen=True, tag=True):
    """Base of all actor messages (tagged, so `match` dispatch and logs show the kind)."""


# --- caller-facing deliveries (items on a caller's output channel) ------------------------------


class Accepted(Msg):
    """The request passed admission: its binding is on record (when auditing) and it is queued."""

    request_id: str
    adapter_fingerprint: str | None


class Delivery(Msg):
    """One item for the caller: Accepted, a RequestOutput, or the exception that ended the request."""

    request_id: str
    item: object


# --- caller -> Admission ------------------------------------------------------------------------


class Submit(Msg):
    """One request for Admission. request_id is the audit key the engine made for it (loraledger.audit_ids);
    caller_request_id the caller's own id (outputs carry it; only one live request may hold it)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    lora_request: LoRARequest | None
    tenant: str | None
    arrival_time: float
    channel: object  # MemoryObjectSendStream[Delivery], owned by the caller's side
    resume: bool = False  # crash recovery: re-run under the binding already on record
    bound_fingerprint: str | None = None  # with resume: the adapter fingerprint the binding names
    # LLM.chat and the chat route: sha256 hex of the chat template that rendered the prompt (the adapter's own, the
    # model's, or the caller's); the binding's chat_template_sha256
    chat_template_sha256: str | None = None
    # the HTTP server's authenticated caller: the API key's id (the binding's key_id; the key also gave `tenant`)
    key_id: str | None = None
    # the caller's own request id (the binding's caller_request_id); and OpenAI's `user` field, put on record in the
    # request_admitted event's payload ("caller")
    caller_request_id: str | None = None
    user: str | None = None
    bound_commit: str | None = None  # with resume: the Hub commit the binding's adapter was read at (read it again)
    # the server's, for a request with tools: loraledger.tool_calls.ToolCallSpec (binding: tools_sha256, tools_text;
    # completions: tool_calls)
    tool_calls: object = None
    # with resume: why its completions' tool calls cannot be read as the first run read them (the binding does not
    # say how: written before revision 0016, or its tools were not kept); the request_resumed event records it
    resume_note: str | None = None
    cache_salt: str | None = (
        None  # the prompt's cache_salt (vLLM's): prefix-cache blocks shared only under the same salt
    )


class Abort(Msg):
    """Abort requests. To Admission: request_ids are caller ids (the live request holding each), audit_ids audit keys;
    Admission frees the caller ids at once (vLLM: an aborted id may be reused) and passes audit keys on. From
    Admission and the OutputAssembler to the Scheduler: audit_ids only."""

    request_ids: list[str] = []
    audit_ids: list[str] = []


class RequestDone(Msg):
    """OutputAssembler -> Admission: the request's final output was released; its id may be reused in flight checks."""

    audit_id: str


# --- adapter management (caller / Admission -> AdapterLoader) -----------------------------------


class ResolveAdapter(Msg):
    lora_request: LoRARequest
    reply: object  # send stream: AdapterResolved
    # a resumed request's: its lora_int_id was given by the engine that admitted it, and may name another adapter here
    # (AdapterResolved.lora_request is the adapter as this engine registers it)
    resumed: bool = False
    at_commit: str | None = None  # a resumed request's: the Hub commit its binding names (the adapter is read at it)


class AdapterResolved(Msg):
    lora_request: LoRARequest
    checkpoint: object = None  # LoraCheckpoint, or None with error set
    error: object = None


class AddLora(Msg):
    lora_request: LoRARequest
    reply: object  # send stream: bool / exception


class RemoveLora(Msg):
    lora_int_id: int
    reply: object


class PinLora(Msg):
    """Pin a registered adapter: the AdapterLoader loads it if need be, keeps it in its host cache and has the
    Scheduler hold it in a device slot (PinSlot), then answers True or the error."""

    lora_int_id: int
    reply: object


class ListLoras(Msg):
    reply: object  # send stream: list[int]


# --- Admission -> Scheduler / OutputAssembler ---------------------------------------------------


class NewRequest(Msg):
    audit_id: str  # the audit key the engine made for the request (past admission, the engine's only key for it)
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None
    checkpoint: object  # LoraCheckpoint or None (base model)
    arrival_time: float
    queued_time: float
    bad_words_token_ids: list[list[int]] = []  # SamplingParams.bad_words tokenized with the request's tokenizer
    caller_request_id: str | None = None  # named in the errors the Scheduler fails the request with
    grammar: object = None  # a grammar_compiler.CompiledConstraint of SamplingParams.structured_outputs
    cache_salt: str | None = None  # Submit.cache_salt


class TrackRequest(Msg):
    """Tell the OutputAssembler about an admitted request before its first token can exist."""

    audit_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None
    adapter_fingerprint: str | None
    arrival_time: float
    queued_time: float
    channel: object
    tokenizer: object = None  # the request's tokenizer (an adapter's own, or the model's); None: no text
    caller_request_id: str | None = None  # RequestOutput.request_id (audit_id is RequestOutput.audit_id)
    tool_calls: object = None  # Submit's ToolCallSpec: each completion's calls are read from its text by it


class PinSlot(Msg):
    """AdapterLoader -> Scheduler: keep an adapter in a device slot (pin_lora); reply: True or the error."""

    fingerprint: str
    checkpoint: object
    reply: object


class UnpinSlot(Msg):
    """AdapterLoader -> Scheduler: a pinned adapter was removed; its slot may be reassigned."""

    fingerprint: str


# --- Scheduler <-> Executor ---------------------------------------------------------------------


class ExecuteStep(Msg):
    """Launch this step; its StepDone comes once the next step is launched (overlap) or a flush arrives.

    flush: finish every launched step (this one included) right after launching it, as a FlushSteps would.
    """

    plan: StepPlan
    flush: bool = False


class FlushSteps(Msg):
    """No further plan is coming until results come back: finish every launched step and report it."""


class StepDone(Msg):
    output: StepOutput | None
    error: object = None  # the exception the step raised; its requests fail, the engine goes on
    step_id: int = -1


# --- Scheduler / OutputAssembler ----------------------------------------------------------------


class SeqUpdate(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """New tokens of one sequence after a step (hot path)."""

    audit_id: str
    seq_index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    ranks: list[int | None] | None = None  # each token's rank (1: the most likely), when logprobs are asked


class RequestTiming(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    audit_id: str
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None
    preempted: bool = False
    prompt_logprobs: list | None = None  # [first position, logprobs, top logprobs, ranks] of a prompt chunk


class StepTokens(Msg):
    updates: list[SeqUpdate]
    timings: list[RequestTiming] = []
    time: float = 0.0


class StopSeq(Msg):
    """OutputAssembler -> Scheduler: a stop string ended this sequence; stop computing it."""

    audit_id: str
    seq_index: int


class RequestFailed(Msg):
    """A request cannot go on (step error, adapter changed); the OutputAssembler ends it with the error."""

    audit_id: str
    error: object


# --- -> AuditWriter -----------------------------------------------------------------------------


class AuditAppend(Msg):
    """Records for the next group commit.

    reply: a send stream that gets None once committed, or the exception if the batch was refused
    (admissions); commit_notify: request ids whose commit the OutputAssembler waits for.
    """

    adapters: list[AdapterRecord] = []
    requests: list[RequestRecord] = []
    completions: list[CompletionRecord] = []
    events: list[EventRecord] = []
    texts: list[TextRecord] = []  # the salted text of the bindings and completions above (store/texts.py)
    reply: object = None
    commit_notify: list[str] = []
    admission: bool = False  # refuse duplicates already in the log; obey audit_on_failure


class AuditCommitted(Msg):
    """AuditWriter -> OutputAssembler: these requests' final rows are durable; release their outputs."""

    audit_ids: list[str]
    receipts: dict[str, dict] = {}  # the signed receipt of each request the commit finished (loraledger/evidence/)


class GetStats(Msg):
    """Ask the Scheduler for its per-step timing summary (engine overhead vs forward time)."""

    reply: object


class AuditRefused(Msg):
    """AuditWriter -> OutputAssembler: the database refused these requests' final rows; they end with the error
    (an output that cannot be put on record is not released as done)."""

    audit_ids: list[str]
    error: object


class Shutdown(Msg):
    reason: str = "engine shutting down"
