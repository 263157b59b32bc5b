"""The response fields vLLM's server sends as null and this one has no value for: added as null, so a client written
against vLLM finds every key it reads (values this server does have are never replaced)."""

from __future__ import annotations

# body level, both routes: disaggregated prefill's KV hand-over, OpenAI's service tier, the prompt's ids
_BODY = ("service_tier", "kv_transfer_params", "prompt_token_ids")
_COMPLETION_CHOICE = ("prompt_token_ids", "token_ids")
_CHAT_CHOICE = ("token_ids",)
# chat message: reasoning models' text, web-search annotations, audio output, the legacy function call
_MESSAGE = ("reasoning", "annotations", "audio", "function_call")
_USAGE = ("prompt_tokens_details",)


def _nulls(target: dict, names: tuple[str, ...]) -> None:
    for name in names:
        target.setdefault(name, None)


def completion_nulls(body: dict) -> dict:
    """A /v1/completions response body with vLLM's null fields."""
    _nulls(body, _BODY)
    for choice in body.get("choices", ()):
        _nulls(choice, _COMPLETION_CHOICE)
    if isinstance(body.get("usage"), dict):
        _nulls(body["usage"], _USAGE)
    return body


def chat_nulls(body: dict) -> dict:
    """A /v1/chat/completions response body with vLLM's null fields."""
    _nulls(body, _BODY)
    for choice in body.get("choices", ()):
        _nulls(choice, _CHAT_CHOICE)
        if isinstance(choice.get("message"), dict):
            _nulls(choice["message"], _MESSAGE)
    if isinstance(body.get("usage"), dict):
        _nulls(body["usage"], _USAGE)
    return body
