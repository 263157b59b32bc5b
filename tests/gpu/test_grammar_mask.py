"""GrammarMask: one batched mask per step over the constrained rows of a batch; the unconstrained rows untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from loraledger.gpu.grammar_mask import GrammarMask
from loraledger.sampling_params import StructuredOutputsParams
from loraledger.structured_outputs import canonical_constraint
from loraledger.structured_outputs.grammar_compiler import GrammarCompiler


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama.model_dir)


def _c(**kw):
    return canonical_constraint(StructuredOutputsParams(**kw))


def test_one_mask_call_leaves_unconstrained_rows_untouched(tokenizer, tiny_llama):
    vocab = tiny_llama.config.vocab_size
    compiled = GrammarCompiler(vocab, (tokenizer.eos_token_id,)).compile(_c(choice=["yes", "no"]), tokenizer)
    logits = torch.randn(4, vocab)
    before = logits.clone()
    mask = GrammarMask(vocab, rows=2)  # grows to the batch
    mask.apply(logits, [None, compiled.matcher(), None, compiled.matcher()])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row in (1, 3):
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert allowed and all(any(c.startswith(tokenizer.decode([t])) for c in ("yes", "no")) for t in allowed)
