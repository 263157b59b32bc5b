"""Structured outputs: the constraint a request sets and the grammar it compiles to.

`constraints.py`: StructuredOutputsParams (vLLM's fields and rules) and the canonical form that names a constraint;
`grammar_compiler.py`: a constraint compiled against a tokenizer's vocabulary, which admission calls (it imports
xgrammar, so it is imported where it is used, not here). Applying a grammar's mask to the logits is device execution:
`gpu/grammar_mask.py`.
"""

from loraledger.structured_outputs.constraints import (
    KINDS,
    MAX_CHOICES,
    MAX_JSON_WHITESPACE,
    MAX_SPEC_CHARS,
    Constraint,
    StructuredOutputsParams,
    canonical_constraint,
    from_canonical,
    frozen_params,
)

__all__ = [
    "KINDS",
    "MAX_CHOICES",
    "MAX_JSON_WHITESPACE",
    "MAX_SPEC_CHARS",
    "Constraint",
    "StructuredOutputsParams",
    "canonical_constraint",
    "frozen_params",
    "from_canonical",
]
