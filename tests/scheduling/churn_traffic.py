"""The churn-serving traffic, drawn here so that the scheduling tests need nothing from bench/.

The draws are the churn-serving benchmark's (seed 7: Poisson arrivals, 64-id prompts, 8-128 new
tokens; adapters Zipf-like over `num_adapters` from seed 8, no base-model requests), so the figures the
tests assert can be set beside that benchmark's live runs in bench/RESULTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIRST_ID = 4  # ids 0..3 are the special tokens


@dataclass(frozen=True)
class Traffic:
    prompts: list[list[int]]
    adapter_of: list[int | None]
    max_tokens: list[int]
    arrivals: list[float] | None = None

    def __len__(self) -> int:
        return len(self.prompts)


def zipf_adapters(rng: np.random.Generator, count: int, num_adapters: int) -> list[int | None]:
    weights = 1.0 / np.arange(1, num_adapters + 1)
    picks = rng.choice(num_adapters, size=count, p=weights / weights.sum())
    rng.random(count)  # the benchmark's base-model draw (its share is 0 here): keeps the later draws equal
    return [int(k) for k in picks]


def churn_traffic(rate: float, num_adapters: int, *, count: int = 256, vocab_size: int = 32000) -> Traffic:
    rng = np.random.default_rng(7)
    gaps = rng.exponential(1.0 / rate, size=count)
    arrivals = (np.cumsum(gaps) - gaps[0]).tolist()  # the first request arrives at t = 0
    prompts = rng.integers(FIRST_ID, vocab_size, size=(count, 64)).tolist()
    zipf_adapters(rng, count, 1)
    max_tokens = rng.integers(8, 128 + 1, size=count).tolist()
    adapters = zipf_adapters(np.random.default_rng(8), count, num_adapters)
    return Traffic(prompts=prompts, adapter_of=adapters, max_tokens=max_tokens, arrivals=arrivals)
