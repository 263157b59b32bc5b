"""Prompt inputs as vLLM takes them: a str, {"prompt": str}, or {"prompt_token_ids": [...]} (optionally with "prompt");
a dict may carry vLLM's "cache_salt"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypedDict

try:
    from typing import NotRequired
except ImportError:  # Python 3.10
    from typing_extensions import NotRequired

from loraledger.errors import PromptError


class TextPrompt(TypedDict):
    """vLLM's text prompt: tokenized by the engine with the request's tokenizer."""

    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache blocks are shared only between requests with the same salt


class TokensPrompt(TypedDict):
    """vLLM's token prompt; "prompt", when given, is the text the ids came from (kept on record, never tokenized)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt


def as_prompt_list(prompts: object) -> list[object]:
    """One prompt (PromptType) or a list of them -> a list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
        return list(prompts)
    raise PromptError(f"prompts must be a str, a dict, or a list of them, got {type(prompts).__name__}")
