"""The model's checks of an admitted request: its prompt as token ids, its bad words, its constraint, and what they need.

check_model_inputs is pure (the tokenizer is an argument; tokenizing is computation, not I/O), so admission runs it
inline, or in a worker thread when a long text prompt makes it slow.
"""

from __future__ import annotations

import msgspec

from loraledger.actors.messages import Submit
from loraledger.errors import LoRADisabledError, NoTokenizerError, PromptError, PromptTooLongError
from loraledger.input_processor.tokenize import bad_words_token_ids, tokenize
from loraledger.structured_outputs import Constraint, canonical_constraint

INLINE_TOKENIZE_CHARS = 4096  # a longer text prompt is checked (tokenized) off the event loop


class ModelInputs(msgspec.Struct, frozen=True):
    """What the model checks make of a request: the ids it runs, the ids it must not generate, its constraint."""

    prompt_token_ids: list[int]
    bad_words_token_ids: list[list[int]]
    constraint: Constraint | None  # canonical form: the grammar and the binding both use it


def shown_id(msg: Submit) -> str:
    """The id an error message names: the caller's own (the one it knows), else the audit key."""
    return msg.caller_request_id or msg.request_id


def check_model_inputs(
    msg: Submit, tokenizer, *, vocab_size: int, max_model_len: int, enable_lora: bool
) -> ModelInputs:
    """The request's model inputs, or the typed error of the first problem, in this order: the prompt (empty, not
    tokenizable, ids outside the vocabulary, too long for max_model_len after truncate_prompt_tokens), the bad words
    (tokenizer, vocabulary), the constraint's canonical form, the tokenizer a constraint needs, and an adapter on an
    engine without LoRA. `tokenizer` is the request's (its adapter's own, or the model's; None without one)."""
    rid = shown_id(msg)
    ids = _prompt_token_ids(msg, tokenizer, vocab_size, max_model_len, rid)
    bad_words = bad_words_token_ids(msg.params.bad_words, tokenizer, vocab_size, rid)
    so = msg.params.structured_outputs
    constraint = None if so is None else canonical_constraint(so)
    if constraint is not None and tokenizer is None:
        raise NoTokenizerError(
            "structured_outputs needs the model's tokenizer (the grammar is matched against its vocabulary), and this "
            "engine was built with skip_tokenizer_init=True"
        )
    lora = msg.lora_request
    if lora is not None and not enable_lora:
        raise LoRADisabledError(
            f"request {rid!r} names adapter {lora.lora_name!r} but the engine was built with enable_lora=False; "
            "pass enable_lora=True (and max_loras / max_lora_rank) to serve adapters"
        )
    return ModelInputs(prompt_token_ids=ids, bad_words_token_ids=bad_words, constraint=constraint)


def _prompt_token_ids(msg: Submit, tokenizer, vocab_size: int, max_model_len: int, rid: str) -> list[int]:
    truncate = msg.params.truncate_prompt_tokens
    if truncate == -1:
        truncate = max_model_len  # vLLM: -1 truncates to the model's length
    if msg.prompt_token_ids is not None:
        ids = msg.prompt_token_ids
        if not ids:
            raise PromptError(f"request {rid!r}: prompt_token_ids is empty; give at least one token")
        ids = list(ids[-truncate:]) if truncate is not None else list(ids)
    else:
        if not isinstance(msg.prompt, str):
            raise PromptError(
                f"request {rid!r}: a prompt must be a str or {{'prompt_token_ids': [...]}}, got {type(msg.prompt).__name__}"
            )
        if msg.prompt == "":
            raise PromptError(f"request {rid!r}: the prompt is empty")
        if tokenizer is None:
            raise NoTokenizerError(
                f"request {rid!r}: a text prompt needs a tokenizer, and this engine was built with skip_tokenizer_init=True; "
                "send {'prompt_token_ids': [...]}"
            )
        ids = tokenize(tokenizer, msg.prompt, truncate)
        if not ids:
            raise PromptError(f"request {rid!r}: the prompt tokenizes to no tokens")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise PromptError(f"request {rid!r}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"request {rid!r}: the prompt has {len(ids)} tokens but max_model_len is {max_model_len}, "
            f"which leaves no room to generate; shorten the prompt to at most {max_model_len - 1} tokens "
            "or raise max_model_len"
        )
    return ids
