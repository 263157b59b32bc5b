"""The scheduling policy's per-request and per-sequence bookkeeping (plain objects the policy alone owns)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from loraledger.lora.request import LoRARequest
from loraledger.sampling_params import SamplingParams
from loraledger.scheduling.step_plan import SamplingSpec


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class SchedRequest:
    audit_id: str  # the audit key the engine made for the request
    order: int  # admission order: lower = older = higher priority
    params: SamplingParams
    lora_request: LoRARequest | None
    checkpoint: object  # LoraCheckpoint | None
    # "" for the base model; also the prefix cache's salt: KV blocks are only shared under the same adapter
    adapter_fingerprint: str
    prompt_len: int
    max_output: int  # min(max_tokens, max_model_len - prompt_len)
    stop_ids: frozenset[int]
    eos_ids: frozenset[int]
    grammar: object = None  # CompiledConstraint of structured_outputs: each sequence gets a matcher of its own
    caller_request_id: str | None = None  # the caller's own id, for the errors the request fails with
    seqs: list[Seq] = field(default_factory=list)
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None
    prompt_logprobs_done: bool = False
    timing_sent: bool = False  # the OutputAssembler has had first_scheduled_time / num_cached_tokens
    blocked_steps: int = 0  # steps spent waiting for an adapter slot while at the head of the queue
    cache_salt: str | None = None  # the caller's (vLLM's prompt cache_salt): KV blocks shared only under the same one

    @property
    def prefix_salt(self) -> str:
        """The prefix cache's salt: the adapter fingerprint, and the caller's cache_salt after a separator neither
        can hold (a fingerprint is hex), so no pair of (fingerprint, salt) can stand for another."""
        if self.cache_salt is None:
            return self.adapter_fingerprint
        return f"{self.adapter_fingerprint}\x00{self.cache_salt}"

    @property
    def shown_id(self) -> str:
        """How errors name the request: the caller's id, with the audit key when the two differ."""
        shown = repr(self.caller_request_id or self.audit_id)
        return shown if self.caller_request_id in (None, self.audit_id) else f"{shown} (audit id {self.audit_id})"


@dataclass(eq=False)
class Seq:
    seq_id: int
    index: int
    request: SchedRequest
    token_ids: list[int]
    spec: SamplingSpec
    num_computed: int = 0  # tokens whose KV the finished steps have computed
    num_scheduled: int = 0  # ... and the steps in flight will have: where the next chunk starts
    pending: int = 0  # steps in flight that sample a token for this sequence (not in token_ids yet)
    status: SeqStatus = SeqStatus.WAITING
    announced: bool = False  # the executor has its NewSeq

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.request.prompt_len

    @property
    def key(self) -> tuple[int, int]:
        return (self.request.order, self.index)
