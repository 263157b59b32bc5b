"""Tokenizing for the model checks: prompts (with vLLM's left truncation) and bad words (as vLLM tokenizes them)."""

from __future__ import annotations

import copy
import threading
import weakref

from loraledger.errors import NoTokenizerError, SamplingParamsError

# per tokenizer, a copy that truncates on the left (vLLM's tokenizers do), and the lock its calls take:
# a fast tokenizer sets its truncation on the shared Rust object for each call
_LEFT: weakref.WeakKeyDictionary[object, tuple[object, threading.Lock]] = weakref.WeakKeyDictionary()
_LEFT_LOCK = threading.Lock()


def tokenize(tokenizer, text: str, truncate: int | None = None) -> list[int]:
    """The prompt's token ids, special tokens added as the tokenizer adds them; with `truncate`, its last
    `truncate` tokens as the tokenizer's left truncation keeps them (vLLM: truncation=True, max_length=k,
    truncation_side="left"; a BOS the tokenizer adds stays)."""
    # encode: transformers' __call__ and encode run the same _encode_plus; a JsonTokenizer runs encode's plain forms itself
    if truncate is None:
        return list(tokenizer.encode(text))
    left, lock = _left_truncating(tokenizer)
    with lock:
        return list(left.encode(text, truncation=True, max_length=truncate))


def _left_truncating(tokenizer) -> tuple[object, threading.Lock]:
    with _LEFT_LOCK:
        entry = _LEFT.get(tokenizer)
        if entry is None:
            left = copy.deepcopy(tokenizer)
            left.truncation_side = "left"
            entry = (left, threading.Lock())
            _LEFT[tokenizer] = entry
        return entry


def bad_words_token_ids(words, tokenizer, vocab_size: int, request_id: str) -> list[list[int]]:
    """vLLM's SamplingParams.update_from_tokenizer: each word tokenized without special tokens, as it would
    start the text and, when that makes a different first token of the same length, after a space (so the
    word is barred at the start of the text and in the middle of it)."""
    if not words:
        return []
    if tokenizer is None:
        raise NoTokenizerError(
            f"request {request_id!r}: bad_words are tokenized with the model's tokenizer, and this engine has none "
            "(skip_tokenizer_init=True); leave bad_words out"
        )
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    outside = sorted({t for ids in out for t in ids if not 0 <= t < vocab_size})
    if outside:
        raise SamplingParamsError(
            f"request {request_id!r}: the model vocabulary size is {vocab_size}, but bad_words tokenize to ids outside it: {outside[:5]}"
        )
    return out
