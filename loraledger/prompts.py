"""Prompt inputs as vLLM takes them: a str, or {"prompt_token_ids": [...]} (optionally with "prompt")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from loraledger.errors import PromptError

PromptType = str | Mapping


def parse_prompt(prompt: object) -> tuple[str | None, list[int] | None]:
    """Return (text, token ids); exactly one is what the engine runs (token ids win when given)."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise PromptError(f"unknown prompt keys {sorted(unknown)}; use 'prompt_token_ids' (and optionally 'prompt')")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise PromptError("'prompt_token_ids' must be a list of ints")
            return prompt.get("prompt"), list(ids)
        if "prompt" in prompt:
            return parse_prompt(prompt["prompt"])
        raise PromptError("a dict prompt needs 'prompt_token_ids' (or 'prompt')")
    raise PromptError(f"a prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}")


def as_prompt_list(prompts: object) -> list[object]:
    """One prompt or a list of them -> a list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
        return list(prompts)
    raise PromptError(f"prompts must be a str, a dict, or a list of them, got {type(prompts).__name__}")
