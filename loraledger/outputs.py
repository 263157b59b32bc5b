"""RequestOutput, CompletionOutput and RequestMetrics, with vLLM's field names.

Both output levels carry the request's LoRARequest (None = the base model), streaming
chunks included, so every piece of text can be attributed to the adapter that wrote it.
"""

from __future__ import annotations

import msgspec

from loraledger.lora_request import LoRARequest

# position -> {token id: logprob}; vLLM uses Logprob objects, a float is what they hold that matters here
SampleLogprobs = list[dict[int, float]]
PromptLogprobs = list[dict[int, float] | None]


class RequestMetrics(msgspec.Struct, kw_only=True):
    """Wall-clock times (time.time()) of a request's life, and what happened to it."""

    arrival_time: float
    queued_time: float | None = None  # entered the scheduler's waiting queue
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    adapter_name: str | None = None
    adapter_fingerprint: str | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None or self.queued_time is None:
            return None
        return self.first_scheduled_time - self.queued_time


class CompletionOutput(msgspec.Struct, kw_only=True):
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    lora_request: LoRARequest | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, kw_only=True):
    """The output of one request so far (or in full, when finished)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    lora_request: LoRARequest | None = None
    num_cached_tokens: int | None = None

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
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
