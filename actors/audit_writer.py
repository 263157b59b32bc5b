"""AuditWriter actor: appends records to the audit store in group commits and acknowledges them once durable.

Everything that arrives while a commit is running goes into the next one, so the cost of a commit
(one fsync on SQLite, one round trip on PostgreSQL) is shared by many records. When the store is
unreachable nothing is dropped: held records are retried with backoff until they commit; new
admissions are refused at once (audit_on_failure="reject", fail closed) or wait ("block").

A store that hangs is unreachable too: each store operation has a deadline (audit_timeout,
enforced by the store), and a write that still has not returned well past it is abandoned here.
Cancelled (the engine's stop ran past its shutdown timeout), the writer answers every message it
still holds with AuditUnavailableError; what was not committed is not on record, and the next
start records those requests as interrupted.
"""

from __future__ import annotations

import math
import threading
import time

import anyio
import msgspec
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.messages import AuditAppend, AuditCommitted, AuditRefused, Shutdown
from loraledger.actors.replies import answer
from loraledger.errors import AuditUnavailableError, DuplicateRequestError, LoraLedgerError
from loraledger.logging import get_logger
from loraledger.store.records import AuditBatch

MAX_BATCH_MESSAGES = 1024
PG_CONNECT_FLOOR_S = 2  # libpq waits at least this long for a connection, whatever the deadline


class AuditWriterStats:
    """Counters the AuditWriter publishes (it alone writes them, on the event loop; anyone may read them)."""

    def __init__(self) -> None:
        self.commits = 0  # group commits done
        self.failures = 0  # writes that failed because the store was unreachable (each retry counts)
        self.refused = 0  # messages the database refused for good (their senders got the error)
        self.held = 0  # messages taken from the inbox and not yet committed
        self.store_down = False


class AuditWriter:
    def __init__(
        self,
        inbox: MemoryObjectReceiveStream,
        assembler: MemoryObjectSendStream,
        store,
        *,
        on_failure: str = "reject",
        retry_initial: float = 0.05,
        retry_max: float = 2.0,
        timeout: float | None = None,
    ) -> None:
        self._inbox = inbox
        self._assembler = assembler
        # AuditStore; this actor writes through it (and only it: the LeaseKeeper renews the lease and recovery claims
        # expired peers through the same store, which is safe across threads)
        self._store = store
        self._on_failure = on_failure
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._attempted: set[str] = set()  # request ids already sent in a write that may have committed
        self._down = False
        # a write runs two store operations, each bounded by timeout (and a new connection by libpq's floor)
        self._give_up_after = math.inf if timeout is None else 2 * (timeout + max(timeout, PG_CONNECT_FLOOR_S)) + 1
        self._writing = threading.Event()  # set while a write runs in its worker thread (abandoned ones included)
        self.commits = 0
        self.stats = AuditWriterStats()
        self._log = get_logger("audit_writer")

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        pending: list[AuditAppend] = []
        try:
            await self._run(pending, task_status)
        finally:
            if pending:  # cancelled with records not on record: nobody waits on them forever
                await self._abandon(pending)

    async def _run(self, pending: list[AuditAppend], task_status: TaskStatus) -> None:
        closing = False
        async with self._inbox, self._assembler:
            task_status.started()
            backoff = self._retry_initial
            while True:
                if not pending:
                    if closing:
                        return
                    try:
                        msg = await self._inbox.receive()
                    except anyio.EndOfStream:
                        return
                    closing |= self._take(msg, pending)
                closing |= self._drain(pending)
                if not pending:
                    continue
                self.stats.held = len(pending)
                if await self._commit(pending):
                    pending.clear()
                    self.stats.held = 0
                    backoff = self._retry_initial
                    continue
                # the store is down: keep what we hold, refuse (or keep) new admissions, retry later
                await self._refuse_admissions(pending)
                with anyio.move_on_after(backoff):
                    while True:
                        try:
                            msg = await self._inbox.receive()
                        except anyio.EndOfStream:
                            closing = True
                            break
                        closing |= self._take(msg, pending)
                        await self._refuse_admissions(pending)
                backoff = min(backoff * 2, self._retry_max)

    def _take(self, msg, pending: list[AuditAppend]) -> bool:
        if isinstance(msg, Shutdown):
            return True
        pending.append(msg)
        return False

    def _drain(self, pending: list[AuditAppend]) -> bool:
        closing = False
        while len(pending) < MAX_BATCH_MESSAGES:
            try:
                msg = self._inbox.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
            closing |= self._take(msg, pending)
        return closing

    async def _refuse_admissions(self, pending: list[AuditAppend]) -> None:
        if self._on_failure != "reject" or not self._down:
            return
        keep = []
        for msg in pending:
            if msg.admission and not any(r.request_id in self._attempted for r in msg.requests):
                rid = msg.requests[0].request_id if msg.requests else "?"
                await answer(
                    msg.reply,
                    AuditUnavailableError(
                        f"request {rid!r} refused: the audit store is unreachable, and no request is served off the record "
                        "(audit_on_failure='reject'); retry when the database is back, or use audit_on_failure='block' to wait"
                    ),
                )
            else:
                keep.append(msg)
        pending[:] = keep

    async def _abandon(self, pending: list[AuditAppend]) -> None:
        error = AuditUnavailableError(
            "the engine stopped before these records were committed (the audit store did not answer in time); "
            "they are not on record"
        )
        self._log.error(
            "engine stopped with audit records not committed",
            requests=[r.request_id for m in pending for r in m.requests]
            + [rid for m in pending for rid in m.commit_notify],
        )
        with anyio.move_on_after(1, shield=True):
            for msg in pending:
                await answer(msg.reply, error)
        pending.clear()

    async def _commit(self, pending: list[AuditAppend]) -> bool:
        started = time.perf_counter()
        try:
            if self._writing.is_set():
                # an abandoned write has still not returned: do not start a second one beside it
                raise AuditUnavailableError("the previous write to the audit store has still not returned")
            receipts: dict = {}  # the signed receipts of the requests this commit finishes, by audit key
            with anyio.move_on_after(self._give_up_after) as scope:
                refused = await anyio.to_thread.run_sync(self._write_once, pending, receipts, abandon_on_cancel=True)
            if scope.cancelled_caught:
                raise AuditUnavailableError(
                    f"the audit store did not answer within {self._give_up_after:g} s: the write is abandoned"
                )
        except AuditUnavailableError as exc:
            if not self._down:
                self._log.error("audit store unreachable; holding records and retrying", error=str(exc))
            self._down = True
            self.stats.failures += 1
            self.stats.store_down = True
            return False
        except LoraLedgerError as exc:
            if len(pending) == 1:
                await self._refuse(pending[0], exc)
                return True
            # something in the batch is bad on its own (not the store): find it, message by message
            self._log.error("audit batch refused; retrying message by message", error=str(exc))
            for msg in list(pending):
                if not await self._commit([msg]):
                    return False  # the store went down meanwhile: keep the rest for the retry
                pending.remove(msg)
            return True
        if self._down:
            self._log.warning("audit store reachable again")
        self._down = False
        self.commits += 1
        self.stats.commits += 1
        self.stats.store_down = False
        # once committed, a retry can no longer be ambiguous: a later submit of these ids is a duplicate
        self._attempted.difference_update(r.request_id for m in pending for r in m.requests)
        notify = []
        for msg in pending:
            outcome = refused.get(id(msg))
            await answer(msg.reply, outcome)
            if outcome is None:
                notify.extend(msg.commit_notify)
        if notify:
            try:
                issued = {rid: msgspec.to_builtins(receipts[rid]) for rid in notify if rid in receipts}
                await self._assembler.send(AuditCommitted(audit_ids=notify, receipts=issued))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # shutting down: the assembler has already failed what it held
        self._log.debug("group commit", messages=len(pending), seconds=round(time.perf_counter() - started, 5))
        return True

    async def _refuse(self, msg: AuditAppend, error: Exception) -> None:
        """A message the database will never accept: its sender learns why, nothing waits for it forever."""
        self._log.error(
            "audit record refused by the database",
            error=str(error),
            requests=[r.request_id for r in msg.requests] + list(msg.commit_notify),
            events=[e.kind for e in msg.events],
        )
        self._attempted.difference_update(r.request_id for r in msg.requests)
        self.stats.refused += 1
        await answer(msg.reply, error)
        if msg.commit_notify:
            try:
                await self._assembler.send(AuditRefused(audit_ids=list(msg.commit_notify), error=error))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    def _write_once(self, pending: list[AuditAppend], receipts: dict) -> dict[int, Exception]:
        # set here, in the thread: a write cancelled before its thread started never runs, and must not
        # keep the next one from starting
        self._writing.set()
        try:
            return self._write(pending, receipts)
        finally:
            self._writing.clear()  # also when the actor stopped waiting for this thread

    def _write(self, pending: list[AuditAppend], receipts: dict) -> dict[int, Exception]:
        """One transaction for the whole group (worker thread). Returns refusals by message id(); the receipts the
        store signed (when it has a log key) go into receipts."""
        refused: dict[int, Exception] = {}
        admission_ids = [
            r.request_id for m in pending if m.admission for r in m.requests if r.request_id not in self._attempted
        ]
        if admission_ids:
            existing = self._store.existing_request_ids(admission_ids)
            for msg in pending:
                if msg.admission and any(r.request_id in existing for r in msg.requests):
                    rid = next(r.request_id for r in msg.requests if r.request_id in existing)
                    refused[id(msg)] = DuplicateRequestError(
                        f"audit key {rid!r} is already in the audit log (audit keys are never reused); leave audit_id out "
                        "and the engine makes a new one"
                    )
        batch = AuditBatch(
            adapters=[a for m in pending if id(m) not in refused for a in m.adapters],
            requests=[r for m in pending if id(m) not in refused for r in m.requests],
            completions=[c for m in pending if id(m) not in refused for c in m.completions],
            events=[e for m in pending if id(m) not in refused for e in m.events],
            texts=[t for m in pending if id(m) not in refused for t in m.texts],
        )
        sent = {r.request_id for r in batch.requests} - self._attempted
        self._attempted.update(sent)
        if batch.adapters or batch.requests or batch.completions or batch.events:
            try:
                if getattr(self._store, "log_key", None) is not None:
                    self._store.write(batch, receipts=receipts)
                else:
                    self._store.write(batch)
            except AuditUnavailableError as exc:
                if not getattr(exc, "maybe_committed", True):
                    # it failed before its commit was sent: nothing of it is on record, a retry is no duplicate,
                    # and its admissions can be refused at once
                    self._attempted.difference_update(sent)
                raise
        return refused
