"""One-shot replies on a reply channel: the one way every actor answers a request/response message."""

from __future__ import annotations

import anyio


async def answer(reply, value: object) -> None:
    """Send `value` on a one-shot reply channel and close it; a caller that stopped waiting is not an error.

    Shielded: a reply cut short by a cancel scope (the AuditWriter's backoff timer, say) would close
    the channel without a value, and the waiting side would see the end of the stream instead of its answer.
    """
    if reply is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            async with reply:
                await reply.send(value)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
