"""The prompt argument at the API edge: one of vLLM's shapes (loraledger.prompts), valid text, and short enough to fit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from loraledger.errors import PromptError, PromptTooLongError
from loraledger.text import storable_text

# a text prompt longer than this many characters per token of max_model_len cannot fit (tokens of
# real text average 3-5 characters); refusing it at once keeps a huge string off the tokenizer
MAX_CHARS_PER_TOKEN = 32
MAX_SALT_CHARS = 1024


def parse_prompt(
    prompt: object, *, max_model_len: int | None = None, truncating: bool = False
) -> tuple[str | None, list[int] | None]:
    """Return (text, token ids) as fresh copies; exactly one is what the engine runs (token ids win when given).

    Checks types (a str, or a dict with a list of int token ids and optionally a str "prompt"),
    that text is valid Unicode, and, given `max_model_len`, that the prompt cannot be too long to
    fit it (with `truncating` — SamplingParams.truncate_prompt_tokens — token ids may be longer: up
    to MAX_CHARS_PER_TOKEN per token of max_model_len, as text); token ids are checked against the
    vocabulary at admission. Raises PromptError.
    """
    if isinstance(prompt, str):
        return _text(prompt, "the prompt", max_model_len), None
    if isinstance(prompt, Mapping):
        try:
            items = dict(prompt)
        except Exception as exc:  # a caller's Mapping whose iteration fails
            raise PromptError(f"the prompt dict cannot be read: {type(exc).__name__}: {exc}") from exc
        unknown = set(items) - {"prompt", "prompt_token_ids", "cache_salt"}
        if unknown:
            raise PromptError(
                f"unknown prompt keys {sorted(map(repr, unknown))}; use 'prompt_token_ids' (and optionally 'prompt' "
                "and 'cache_salt')"
            )
        text = items.get("prompt")
        if "prompt_token_ids" in items:
            ids = _token_ids(items["prompt_token_ids"], max_model_len, truncating)
            # the text beside token ids is only recorded: bounded like a prompt that would fit
            return (None if text is None else _text(text, "the prompt dict's 'prompt'", max_model_len)), ids
        if text is None:
            raise PromptError("a dict prompt needs 'prompt_token_ids' (or a str 'prompt')")
        return _text(text, "the prompt", max_model_len), None
    raise PromptError(f"a prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}")


def prompt_cache_salt(prompt: object) -> str | None:
    """A prompt dict's `cache_salt` (vLLM's): KV blocks of the prefix cache are shared only between requests with the
    same salt (and the same adapter), so a tenant's prompts cannot be probed through cache timing. None when absent."""
    if not isinstance(prompt, Mapping) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise PromptError(f"the prompt's 'cache_salt' must be a non-empty str, got {type(salt).__name__}")
    return storable_text(salt, "the prompt's 'cache_salt'", PromptError, max_chars=MAX_SALT_CHARS, allow_nul=False)


def _text(value: object, what: str, max_model_len: int | None) -> str:
    if not isinstance(value, str):
        raise PromptError(f"{what} must be a str, got {type(value).__name__}")
    if max_model_len is not None and len(value) > MAX_CHARS_PER_TOKEN * max_model_len:
        raise PromptTooLongError(
            f"{what} has {len(value)} characters: more than {MAX_CHARS_PER_TOKEN} per token of max_model_len={max_model_len}, "
            "so it cannot fit; shorten the prompt"
        )
    return storable_text(value, what, PromptError)


def _token_ids(ids: object, max_model_len: int | None, truncating: bool = False) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise PromptError(f"'prompt_token_ids' must be a list of ints, got {type(ids).__name__}")
    if truncating and max_model_len is not None:
        if len(ids) > MAX_CHARS_PER_TOKEN * max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens: more than {MAX_CHARS_PER_TOKEN} times max_model_len={max_model_len}, "
                "even for truncate_prompt_tokens; shorten the prompt"
            )
    elif max_model_len is not None and len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens but max_model_len is {max_model_len}, which leaves no room to generate; "
            f"shorten the prompt to at most {max_model_len - 1} tokens or raise max_model_len"
        )
    out = list(ids)
    bad = [t for t in out if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 1 << 63]
    if bad:
        shown = ", ".join(_shown(t) for t in bad[:5])
        raise PromptError(f"'prompt_token_ids' must hold token ids (ints in [0, 2**63)); found {shown}")
    return [t if type(t) is int else int(t) for t in out]


def _shown(value: object) -> str:
    if isinstance(value, int) and value.bit_length() > 128:
        return f"<int of {value.bit_length()} bits>"
    try:
        return repr(value)[:40]
    except Exception:
        return f"<{type(value).__name__}>"
