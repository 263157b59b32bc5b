"""LeaseKeeper actor: renews this engine's lease in the audit database, so that peers sharing it know it is alive.

It renews every third of the lease (audit_lease_seconds), each renewal a store operation under the
audit_timeout deadline, so two renewals may fail and the lease still holds. A renewal that fails
because the store does not answer is retried at the next tick (the writer holds records meanwhile);
one that finds the lease recovered by a peer (it expired: this engine was stalled or cut off for
longer than the lease) raises InstanceLeaseLostError, which stops the engine: its unfinished
requests are on record as interrupted, and the store already refuses its writes. On a clean stop the
lease is released, so peers recover whatever was left at once instead of waiting for it to expire.
"""

from __future__ import annotations

import time

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from loraledger.actors.messages import Shutdown
from loraledger.errors import AuditUnavailableError
from loraledger.logging import get_logger

RENEWALS_PER_LEASE = 3


class LeaseKeeperStats:
    """Counters the LeaseKeeper publishes (it alone writes them)."""

    def __init__(self) -> None:
        self.renewals = 0
        self.failures = 0  # renewals the store did not answer
        self.expires_at = 0.0  # unix seconds (the database's clock) of the lease as last renewed


class LeaseKeeper:
    def __init__(self, inbox: MemoryObjectReceiveStream, store, *, lease_seconds: float) -> None:
        self._inbox = inbox
        self._store = (
            store  # AuditStore with a registered instance; this actor calls renew_lease and release_lease only
        )
        self._interval = lease_seconds / RENEWALS_PER_LEASE
        self._lease_seconds = lease_seconds
        self.stats = LeaseKeeperStats()
        self._log = get_logger("lease_keeper")

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox:
            task_status.started()
            renewed_at = time.monotonic()
            while True:
                with anyio.move_on_after(self._interval):
                    try:
                        msg = await self._inbox.receive()
                    except anyio.EndOfStream:
                        msg = Shutdown()
                    if isinstance(msg, Shutdown):
                        await self._release()
                        return
                try:
                    self.stats.expires_at = await anyio.to_thread.run_sync(self._store.renew_lease)
                except AuditUnavailableError as exc:
                    self.stats.failures += 1
                    late = time.monotonic() - renewed_at
                    self._log.warning("lease renewal failed; retrying", error=str(exc), seconds_since_renewal=round(late, 2),
                                      lease_seconds=self._lease_seconds)  # fmt: skip
                    continue
                # InstanceLeaseLostError goes on: a broken engine invariant, the engine stops
                self.stats.renewals += 1
                renewed_at = time.monotonic()

    async def _release(self) -> None:
        with anyio.move_on_after(self._store.timeout or 5.0, shield=True):
            try:
                await anyio.to_thread.run_sync(self._store.release_lease, abandon_on_cancel=True)
            except AuditUnavailableError as exc:  # peers wait for the lease to expire instead
                self._log.warning("could not release the lease at stop", error=str(exc))
