"""What a request fails with when an actor could not handle one of its messages: the failure boundary's one rule."""

from __future__ import annotations

from loraledger.errors import LoraLedgerError, RequestFailedError


def request_error(exc: BaseException, request_id: str, where: str) -> LoraLedgerError:
    """Our own typed errors as they are; anything else (a bug, an input no check foresaw) as RequestFailedError
    naming the request and the actor, with `exc` attached as its cause. Only that request fails: the actor
    that caught `exc` goes on with its other messages."""
    if isinstance(exc, LoraLedgerError):
        return exc
    error = RequestFailedError(
        f"request {request_id!r} failed in the {where} ({type(exc).__name__}: {_short(exc)}); the engine goes on serving "
        "other requests. This is a bug in loraledger or an input it does not check yet: please report it with this message"
    )
    error.__cause__ = exc
    return error


def _short(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = "<unprintable>"
    return text if len(text) <= 300 else text[:300] + "..."
