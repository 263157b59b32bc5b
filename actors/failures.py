"""What a request fails with when an actor could not handle one of its messages: the failure boundary's one rule."""

from __future__ import annotations

from loraledger.errors import LoraLedgerError, RequestFailedError


def request_error(exc: BaseException, request_id: str, where: str, audit_id: str | None = None) -> LoraLedgerError:
    """Our own typed errors as they are; anything else (a bug, an input no check foresaw) as RequestFailedError
    naming the request (the caller's id, and its audit key when the actor knows both) and the actor, with `exc`
    attached as its cause. Only that request fails: the actor that caught `exc` goes on with its other messages."""
    if isinstance(exc, LoraLedgerError):
        return exc
    named = repr(request_id) if audit_id is None or audit_id == request_id else f"{request_id!r} (audit id {audit_id})"
    error = RequestFailedError(
        f"request {named} failed in the {where} ({type(exc).__name__}: {_short(exc)}); the engine goes on serving "
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
