"""AuditWriter actor: appends records to the audit store in group commits and acknowledges them once durable.

Everything that arrives while a commit is running goes into the next one, so the cost of a commit
(one fsync on SQLite, one round trip on PostgreSQL) is shared by many records. When the store is
unreachable nothing is dropped: held records are retried with backoff until they commit; new
admissions are refused at once (audit_on_failure="reject", fail closed) or wait ("block").
"""

from __future__ import annotations

import time

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from loraledger.actors.messages import AuditAppend, AuditCommitted, AuditRefused, Shutdown
from loraledger.errors import AuditUnavailableError, DuplicateRequestError, LoraLedgerError
from loraledger.actors.replies import answer
from loraledger.logging import get_logger
from loraledger.store.records import AuditBatch

MAX_BATCH_MESSAGES = 1024


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
    ) -> None:
        self._inbox = inbox
        self._assembler = assembler
        self._store = store  # AuditStore; only this actor (and its worker thread) touches it
        self._on_failure = on_failure
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._attempted: set[str] = set()  # request ids already sent in a write that may have committed
        self._down = False
        self.commits = 0
        self._log = get_logger("audit_writer")

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        pending: list[AuditAppend] = []
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
                if await self._commit(pending):
                    pending = []
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

    async def _commit(self, pending: list[AuditAppend]) -> bool:
        started = time.perf_counter()
        try:
            refused = await anyio.to_thread.run_sync(self._write, pending)
        except AuditUnavailableError as exc:
            if not self._down:
                self._log.error("audit store unreachable; holding records and retrying", error=str(exc))
            self._down = True
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
                await self._assembler.send(AuditCommitted(request_ids=notify))
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
        await answer(msg.reply, error)
        if msg.commit_notify:
            try:
                await self._assembler.send(AuditRefused(request_ids=list(msg.commit_notify), error=error))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    def _write(self, pending: list[AuditAppend]) -> dict[int, Exception]:
        """One transaction for the whole group (worker thread). Returns refusals by message id()."""
        refused: dict[int, Exception] = {}
        admission_ids = [r.request_id for m in pending if m.admission for r in m.requests if r.request_id not in self._attempted]
        if admission_ids:
            existing = self._store.existing_request_ids(admission_ids)
            for msg in pending:
                if msg.admission and any(r.request_id in existing for r in msg.requests):
                    rid = next(r.request_id for r in msg.requests if r.request_id in existing)
                    refused[id(msg)] = DuplicateRequestError(
                        f"request id {rid!r} is already in the audit log (ids are never reused); submit it under a new id"
                    )
        batch = AuditBatch(
            adapters=[a for m in pending if id(m) not in refused for a in m.adapters],
            requests=[r for m in pending if id(m) not in refused for r in m.requests],
            completions=[c for m in pending if id(m) not in refused for c in m.completions],
            events=[e for m in pending if id(m) not in refused for e in m.events],
        )
        self._attempted.update(r.request_id for r in batch.requests)
        if batch.adapters or batch.requests or batch.completions or batch.events:
            self._store.write(batch)
        return refused
