"""Replies: one-shot answers on a reply channel (the one way every actor answers a request/response message), and
deliveries on a request's output channel (its outputs, then its last one, which closes it)."""

from __future__ import annotations

import anyio

from loraledger.actors.messages import Delivery


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


async def deliver(channel, request_id: str, item: object) -> None:
    """One output (or error) on a request's channel; a caller that stopped listening is not an error (it aborts the
    request itself)."""
    try:
        await channel.send(Delivery(request_id=request_id, item=item))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass


async def deliver_last(channel, request_id: str, item: object) -> None:
    """A request's last delivery (its final output, or why it failed or was refused), then its channel closed:
    nothing more comes, and an unclosed channel is warned of when it is collected (at interpreter exit, as an
    "Exception ignored" traceback)."""
    try:
        await deliver(channel, request_id, item)
    finally:
        channel.close()
