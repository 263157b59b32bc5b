"""Engines over the tiny fixtures, shared per module (building one takes about a second)."""

from __future__ import annotations

import random

import pytest

from loraledger import LLM, LoRARequest


def loras_for(tiny) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(sorted(tiny.adapters.items()))}


def random_prompts(n: int, seed: int, vocab: int = 512, lo: int = 3, hi: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    # skip the 4 special tokens so the prompts look like text
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def llama_llm(tiny_llama):
    llm = LLM(
        model=str(tiny_llama.model_dir),
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        block_size=4,
        audit_url=None,
        seed=0,
    )
    yield llm
    llm.close()
