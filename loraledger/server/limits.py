"""ServerLimits: every bound on what one HTTP caller may make the server do (the counts and sizes a body controls, the
waits on a client, the sandbox of a request's chat template), with their defaults; check_sampling_lists applies the
list bounds to a request body (400 naming the field, its size, the bound and the flag that raises it).

Stop strings and bad words are matched on every generated token, so their number and total size bound the cost of
each step for every caller sharing the engine; the token-id lists and logit_bias bound per-step work the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from loraledger.errors import ConfigError
from loraledger.server.error_responses import APIError


@dataclass(frozen=True)
class ServerLimits:
    max_stop_strings: int = 64  # `stop` strings, and `bad_words`, per request (each list)
    max_stop_chars: int = 8192  # their total characters (each list)
    max_token_id_list: int = 4096  # entries of `stop_token_ids` and `allowed_token_ids`
    max_logit_bias: int = 1024  # entries of `logit_bias`
    max_rendered_chars: int = 1 << 22  # characters a chat conversation may render to (4 Mi)
    chat_template_seconds: float = (
        5.0  # a request's own chat template (--trust-request-chat-template) must render in this
    )
    body_seconds: float = 30.0  # a request body must have arrived this long after its headers
    send_seconds: float = (
        30.0  # each write of an answer must go out within this (a client that stops reading is cut off)
    )
    max_body_readers: int = 256  # requests whose body is still arriving, at once; more get 503 (slow clients' budget)
    header_seconds: float = (
        10.0  # a connection's request headers must be complete this long after it opens (or after its last response)
    )
    max_connections_per_client: int = (
        256  # open connections from one client address (a proxy in front is one); more are closed at once
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"ServerLimits.{f.name} must be a positive number, got {value!r}")


# body field -> (the ServerLimits count bound, the flag that sets it)
_COUNTED = {
    "stop": ("max_stop_strings", "--max-stop-strings"),
    "bad_words": ("max_stop_strings", "--max-stop-strings"),
    "stop_token_ids": ("max_token_id_list", "--max-token-id-list"),
    "allowed_token_ids": ("max_token_id_list", "--max-token-id-list"),
    "logit_bias": ("max_logit_bias", "--max-logit-bias"),
}


def check_sampling_lists(req, limits: ServerLimits) -> None:
    """400 for a body whose stop / bad_words / token-id lists / logit_bias are over the server's bounds."""
    for name, (bound_name, flag) in _COUNTED.items():
        value = getattr(req, name, None)
        if value is None:
            continue
        items = [value] if isinstance(value, str) else value
        bound = getattr(limits, bound_name)
        if len(items) > bound:
            raise APIError(
                400,
                f"{name} has {len(items)} entries; this server takes at most {bound} (its {flag})",
                param=name,
                code="limit_exceeded",
            )
        if name in ("stop", "bad_words"):
            chars = sum(len(s) for s in items)
            if chars > limits.max_stop_chars:
                raise APIError(
                    400,
                    f"{name} holds {chars} characters in all; this server takes at most {limits.max_stop_chars} "
                    "(its --max-stop-chars)",
                    param=name,
                    code="limit_exceeded",
                )
