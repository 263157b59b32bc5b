"""GrammarCompiler (compile once per canonical form, bounded, typed errors) and GrammarMask (one batched mask per step)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from loraledger.errors import StructuredOutputError
from loraledger.gpu.grammar_compiler import GrammarCompiler
from loraledger.gpu.grammar_mask import GrammarMask
from loraledger.sampling_params import StructuredOutputsParams
from loraledger.structured_outputs import canonical_constraint


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama.model_dir)


def _c(**kw):
    return canonical_constraint(StructuredOutputsParams(**kw))


def test_the_cache_is_keyed_by_canonical_form_and_bounded(tokenizer, tiny_llama):
    compiler = GrammarCompiler(tiny_llama.config.vocab_size, (tokenizer.eos_token_id,), max_cached=2)
    a = compiler.compile(_c(json={"type": "object", "properties": {"x": {"type": "integer"}}}), tokenizer)
    assert compiler.compile(_c(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'), tokenizer) is a
    compiler.compile(_c(regex="[0-9]+"), tokenizer)
    compiler.compile(_c(choice=["a", "b"]), tokenizer)  # the third: the least recently used (the schema) goes
    assert compiler.compiles == 3
    assert compiler.compile(_c(json={"type": "object", "properties": {"x": {"type": "integer"}}}), tokenizer) is not a
    assert compiler.compiles == 4 and a.kind == "json" and len(a.sha256) == 64


def test_a_compile_error_names_the_problem_without_the_engine_s_source_location(tokenizer, tiny_llama):
    compiler = GrammarCompiler(tiny_llama.config.vocab_size, (tokenizer.eos_token_id,))
    with pytest.raises(
        StructuredOutputError,
        match=r'json constraint \(sha256 [0-9a-f]{12}\) does not compile: Unsupported type "nonsense"',
    ):
        compiler.compile(_c(json={"type": "nonsense"}), tokenizer)
    with pytest.raises(StructuredOutputError, match="grammar constraint .* does not compile: EBNF lexer error") as info:
        compiler.compile(_c(grammar="root ::= ["), tokenizer)
    assert ".cc:" not in str(info.value)


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
