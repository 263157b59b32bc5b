"""The contract between the Scheduler and the Executor: what to compute in one step and what came out.

Sequences are the unit of work (a request with n > 1 has n sequences). The Scheduler owns
block allocation and adapter-slot assignment; the Executor owns weights, KV cache, adapter
slot tensors and the per-sequence sampling state, which it keeps from a sequence's NewSeq
until its id appears in freed_seq_ids.

Overlapped steps: the Scheduler may plan step N+1 before step N's tokens are back. A sequence
that step N samples then runs in step N+1 with PENDING_TOKEN as its last token id, which the
runner replaces on the device with the token step N sampled for it: the id never makes the round
trip to the host and back before the next forward pass.
"""

from __future__ import annotations

import msgspec

PENDING_TOKEN = -1  # SeqWork.token_ids[-1]: "the token the previous plan samples for this sequence"


class SamplingSpec(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """What the sampler needs of a request's SamplingParams, per sequence."""

    temperature: float = 0.0  # < 1e-5: greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0  # always set: the scheduler derives one for unseeded requests
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = -1  # -1: none; k >= 0: the sampled token's logprob plus the top k (the vocabulary size for all)
    prompt_logprobs: int = -1  # -1: none; k >= 0: logprob of each prompt token plus the top k
    min_tokens: int = 0  # while fewer outputs exist, the ids in stop_ids cannot be sampled
    stop_ids: list[int] = []  # EOS (unless ignore_eos) + stop_token_ids
    bias_token_ids: list[int] = []  # logit_bias: these ids' logits get bias_values added
    bias_values: list[float] = []
    allowed_token_ids: list[int] = []  # non-empty: only these ids can be sampled
    bad_words: list[list[int]] = []  # each word's last id is barred when the outputs end with the rest of it

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the values of earlier outputs (penalties, bad words of several tokens), not only their count."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or any(len(word) > 1 for word in self.bad_words)
        )

    @property
    def controls_tokens(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words change this row's logits."""
        return bool(self.bias_token_ids or self.allowed_token_ids or self.bad_words)


class NewSeq(msgspec.Struct, frozen=True, array_like=True):
    """First appearance of a sequence: the executor creates its sampling state."""

    seq_id: int
    sampling: SamplingSpec
    prompt_token_ids: list[int]  # for repetition penalty and prompt logprobs
    output_token_ids: list[int] = []  # tokens generated before (after preemption of a forked sequence)
    grammar: object = None  # a grammar_compiler.CompiledConstraint: the sequence's output is constrained to it


class SeqWork(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's share of a step."""

    seq_id: int
    token_ids: list[int]  # the tokens to run this step: a prompt chunk, a recompute chunk, or the last sampled token
    # (the last may be PENDING_TOKEN: sampled by the previous plan, still on the device)
    start_pos: int  # position of token_ids[0] = number of tokens whose KV is already in the cache
    block_table: list[int]  # the sequence's whole block table, long enough for start_pos + len(token_ids)
    lora_slot: int  # device adapter slot, -1 = base model
    sample: bool  # sample one token after the last of token_ids (false for a non-final prompt chunk)
    prompt_logprobs: bool = False  # return logprobs of the prompt tokens in token_ids[1:] (+ the next chunk's first)


class SlotLoad(msgspec.Struct, frozen=True):
    """Copy an adapter into a device slot before the step (the checkpoint is immutable host memory)."""

    slot: int
    fingerprint: str
    checkpoint: object  # loraledger.lora.checkpoint.LoraCheckpoint


class StepPlan(msgspec.Struct, frozen=True):
    step_id: int
    seqs: list[SeqWork]
    new_seqs: list[NewSeq] = []
    freed_seq_ids: list[int] = []
    slot_loads: list[SlotLoad] = []
    slot_clears: list[int] = []


class SampledToken(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    seq_id: int
    token_id: int
    logprob: float  # log_softmax of the raw logits at the sampled token
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first, when asked
    rank: int | None = None  # the sampled token's rank in the raw logits (1: the most likely), when logprobs are asked
    grammar_done: bool = False  # the sequence's grammar is complete with this token: nothing more may follow
    # the grammar refused this token (the request's other masks left none it allows): the request fails
    grammar_refused: bool = False


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    seq_id: int
    first_pos: int  # position of the first prompt token these logprobs score
    logprobs: list[float]  # logprob of prompt token at first_pos + i
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ranks: list[int] | None = None  # rank of prompt token at first_pos + i (1: the most likely)


class StepOutput(msgspec.Struct, frozen=True):
    step_id: int
    sampled: list[SampledToken]
    prompt_logprobs: list[PromptLogprobs] = []
    forward_seconds: float = 0.0  # model forward + sampling, measured in the worker thread
    prepare_seconds: float = 0.0  # building the input tensors from the plan
    gpu_seconds: float | None = None  # CUDA: the step's device time, from events around its work
    gpu_idle_seconds: float | None = (
        None  # CUDA: how long the device waited between the last step's work and this one's
    )
