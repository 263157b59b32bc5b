"""SchedulerConfig: every knob of the scheduling policy and of the scheduler actor around it, in one frozen struct."""

from __future__ import annotations

import msgspec


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int  # the token budget of one step
    max_model_len: int
    max_loras: int  # adapter slots on the device: distinct adapters one step can serve
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    # the generation config's EOS ids beyond eos_token_ids: as in vLLM they join each request's stop_token_ids
    # (unless ignore_eos), so they end it with that id as its stop_reason
    extra_stop_ids: tuple[int, ...] = ()
    seed: int | None = None  # seeds the draws of the requests that give no seed
    vocab_size: int | None = None  # what logprobs=-1 asks for
    chunked_prefill: bool = True  # False: a prompt is scheduled whole in one step, never in chunks
    # steps the head of the queue may wait for an adapter slot before a running adapter is drained for it
    max_head_skips: int = 8
    # the actor's: steps in flight at once; 1 waits for each step's tokens, 2 plans each step while the one before runs
    depth: int = 1
