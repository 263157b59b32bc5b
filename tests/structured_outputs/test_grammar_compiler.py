"""GrammarCompiler: compiles once per canonical form, keeps a bounded cache, fails with typed errors."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from loraledger.errors import StructuredOutputError
from loraledger.sampling_params import StructuredOutputsParams
from loraledger.structured_outputs import canonical_constraint
from loraledger.structured_outputs.grammar_compiler import GrammarCompiler


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
