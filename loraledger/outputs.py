"""RequestOutput, CompletionOutput, Logprob and RequestStateStats, with vLLM's names, field order and meanings.

Both output levels carry the request's LoRARequest (None = the base model), streaming
chunks included, so every piece of text can be attributed to the adapter that wrote it.
"""

from __future__ import annotations

import msgspec

from loraledger.lora.request import LoRARequest


class Logprob(msgspec.Struct):
    """vLLM's Logprob: a token's log probability, its rank in the vocabulary (1: the most likely) and its text.

    decoded_token is the token decoded alone (tokenizer.decode([id])); None when the request is not
    detokenized (detokenize=False, or an engine without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: {token id: Logprob} for the chosen token and the top alternatives (vLLM's types)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # the first prompt position has none


class RequestStateStats(msgspec.Struct, kw_only=True):
    """vLLM's per-request statistics (vllm.v1.metrics.stats.RequestStateStats), with its field names.

    Every time is wall-clock (time.time()); vLLM takes the *_ts ones from a monotonic clock, so
    compare them with each other, not with other clocks. 0.0 means "not yet", as in vLLM. The
    adapter's name and content fingerprint, and when the request finished, are ours.
    """

    arrival_time: float = 0.0  # the request reached the engine
    queued_ts: float = 0.0  # it was admitted (its binding on record) and queued for the scheduler
    scheduled_ts: float = 0.0  # its first step was planned
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0  # first_token_ts - arrival_time
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    is_corrupted: bool = False  # vLLM: NaNs in the logits; never set here
    finished_ts: float = 0.0
    adapter_name: str | None = None
    adapter_fingerprint: str | None = None


RequestMetrics = RequestStateStats  # the name these statistics had here before


class CompletionOutput(msgspec.Struct):
    """One generated sequence of a request; positional arguments in vLLM's field order."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    routed_experts: object = None  # vLLM: the experts a MoE model routed to; None here (no MoE models)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    lora_request: LoRARequest | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class _RequestOutputFields(msgspec.Struct):
    """RequestOutput's positional fields, in vLLM's order."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestStateStats | None = None
    lora_request: LoRARequest | None = None
    encoder_prompt: str | None = None  # vLLM: encoder-decoder models; None here
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None


class RequestOutput(_RequestOutputFields, kw_only=True):
    """The output of one request so far (or in full, when finished); positional arguments in vLLM's order,
    then vLLM's keyword-only ones (None here: no multimodal inputs, no disaggregated KV transfer), then ours.

    request_id is the caller's id, as in vLLM (LLM.generate numbers its requests "0", "1", ...; a caller may reuse
    an id once its request has finished). audit_id is the key the audit log files the request under: an id the
    engine made (a UUIDv7, unique across engines and restarts, ordered by time); `loraledger audit show AUDIT_ID`
    shows its record, and `requests.caller_request_id` holds request_id beside it.
    """

    multi_modal_placeholders: dict | None = None
    kv_transfer_params: dict | None = None
    audit_id: str | None = None  # None only for outputs made outside the engine

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one.

        With aggregate=True (DELTA chunks being summed up) text, token ids and logprobs are
        appended; otherwise each completion is replaced by the newer one.
        """
        if next_output.request_id != self.request_id:
            raise ValueError(f"cannot add output of {next_output.request_id!r} to {self.request_id!r}")
        self.finished |= next_output.finished
        self.metrics = next_output.metrics or self.metrics
        if next_output.num_cached_tokens is not None:
            self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        for completion in next_output.outputs:
            for i, mine in enumerate(self.outputs):
                if mine.index == completion.index:
                    if aggregate:
                        mine.text += completion.text
                        mine.token_ids = list(mine.token_ids) + list(completion.token_ids)
                        if completion.logprobs is not None:
                            mine.logprobs = (mine.logprobs or []) + completion.logprobs
                        mine.cumulative_logprob = completion.cumulative_logprob
                        mine.finish_reason = completion.finish_reason
                        mine.stop_reason = completion.stop_reason
                    else:
                        self.outputs[i] = completion
                    break
            else:
                self.outputs.append(completion)
                self.outputs.sort(key=lambda c: c.index)
