"""Seeded request sets: random prompt token ids, adapter bindings (round-robin or Zipf), output lengths, arrivals."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# ids 0..3 are the special tokens; prompts avoid them so no prompt carries a stray BOS/EOS/PAD
FIRST_ID = 4


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    adapter_of: list[int | None]  # adapter index per prompt, None = base model
    max_tokens: list[int]  # new tokens per prompt (generated in full: ignore_eos / min_new_tokens)
    arrivals: list[float] | None = None  # seconds after the start, for the serving scenario

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def generated_tokens(self) -> int:
        return int(sum(self.max_tokens))


def random_prompts(rng: np.random.Generator, count: int, length: int, vocab_size: int) -> list[list[int]]:
    return rng.integers(FIRST_ID, vocab_size, size=(count, length)).tolist()


def round_robin(count: int, num_adapters: int) -> list[int | None]:
    """Prompt j -> adapter j mod (num_adapters + 1), where num_adapters itself means the base model."""
    return [j % (num_adapters + 1) if j % (num_adapters + 1) < num_adapters else None for j in range(count)]


def zipf_choices(
    rng: np.random.Generator, count: int, num_adapters: int, exponent: float, base_share: float
) -> list[int | None]:
    """Adapter k drawn with weight 1 / (k + 1)**exponent; a `base_share` of requests use the base model."""
    weights = 1.0 / np.arange(1, num_adapters + 1) ** exponent
    picks = rng.choice(num_adapters, size=count, p=weights / weights.sum())
    base = rng.random(count) < base_share
    return [None if b else int(k) for k, b in zip(picks, base)]


def batch_workload(
    seed: int, *, num_prompts: int, prompt_len: int, max_tokens: int, vocab_size: int, num_adapters: int
) -> Workload:
    """Scenario 1's request set; scenario 3 uses `.base_only()` of the same one."""
    rng = np.random.default_rng(seed)
    return Workload(
        prompts=random_prompts(rng, num_prompts, prompt_len, vocab_size),
        adapter_of=round_robin(num_prompts, num_adapters),
        max_tokens=[max_tokens] * num_prompts,
    )


def base_only(workload: Workload) -> Workload:
    return Workload(workload.prompts, [None] * len(workload), workload.max_tokens, workload.arrivals)


def serving_workload(
    seed: int,
    *,
    num_requests: int,
    rate: float,
    prompt_len: int,
    min_tokens: int,
    max_tokens: int,
    vocab_size: int,
    num_adapters: int,
    zipf_exponent: float,
    base_share: float,
) -> Workload:
    """Poisson arrivals at `rate` requests/s, output lengths uniform in [min_tokens, max_tokens], Zipf adapters."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=num_requests)
    arrivals = (np.cumsum(gaps) - gaps[0]).tolist()  # the first request arrives at t = 0
    return Workload(
        prompts=random_prompts(rng, num_requests, prompt_len, vocab_size),
        adapter_of=zipf_choices(rng, num_requests, num_adapters, zipf_exponent, base_share),
        max_tokens=rng.integers(min_tokens, max_tokens + 1, size=num_requests).tolist(),
        arrivals=arrivals,
    )
