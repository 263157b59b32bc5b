"""The request fields beyond sampling that OpenAI's and vLLM's clients send: where each one goes, and the Warning
header that names the fields a response ignored (protocol.IGNORED)."""

from __future__ import annotations

from typing import Any

from loraledger.server.error_responses import APIError

WARNING_HEADER = "Warning"
MAX_CALLER_ID_CHARS = 256  # a caller's request id, from the X-Request-Id header or the body's request_id


def valid_caller_id(value: str) -> bool:
    return 0 < len(value) <= MAX_CALLER_ID_CHARS and value.isprintable()


def caller_id(header_id: str | None, body) -> str | None:
    """The caller's request id: the X-Request-Id header's, else the body's `request_id` (vLLM's field; the header
    wins, as in vLLM's server), else None (the server makes one)."""
    if header_id is not None:
        return header_id
    body_id = getattr(body, "request_id", None)
    if body_id is None:
        return None
    if not valid_caller_id(body_id):
        raise APIError(400, f"request_id must be 1-{MAX_CALLER_ID_CHARS} printable characters", param="request_id")
    return body_id


def template_kwargs(req) -> dict[str, Any] | None:
    """The chat template's extra variables: the body's chat_template_kwargs, plus `reasoning_effort` as the variable
    of that name (vLLM gives it to the template so; templates of reasoning models read it, others leave it unused).
    A reasoning_effort inside chat_template_kwargs wins."""
    kwargs = req.chat_template_kwargs
    effort = getattr(req, "reasoning_effort", None)
    if effort is None or (isinstance(kwargs, dict) and "reasoning_effort" in kwargs):
        return kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        return kwargs  # render_chat refuses it by name
    return {**(kwargs or {}), "reasoning_effort": effort}


def prompt_with_salt(prompt: object, cache_salt: str | None) -> object:
    """An engine prompt carrying vLLM's `cache_salt` (a text prompt becomes {"prompt": text, "cache_salt": ...}):
    the prefix cache then shares KV blocks only between requests with the same salt."""
    if cache_salt is None:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": cache_salt}
    return {**prompt, "cache_salt": cache_salt}


def ignored_warning(body) -> str | None:
    """An RFC 7234 Warning (code 299, persistent) naming the fields this body held that the server ignored; None
    when it held none."""
    fields = getattr(body, "ignored_fields", ())
    if not fields:
        return None
    return f'299 loraledger "ignored fields without effect on this server: {", ".join(fields)}"'
