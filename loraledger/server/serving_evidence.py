"""The log's evidence over HTTP: signed checkpoints, inclusion and consistency proofs, receipts, the log's verifier key.

Read from the audit database the engine writes (its own connection, never the engine's actors), in a
worker thread under the audit deadline; checkpoints are signed with the engine's log key.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio

from loraledger.errors import AuditUnavailableError, EvidenceError
from loraledger.server.auth import Caller
from loraledger.server.error_responses import APIError


class ServingEvidence:
    def __init__(self, state: Any) -> None:
        self._state = state
        self._log: Any = None
        self._key: Any = None
        self._lock = threading.Lock()

    def _opened(self) -> tuple[Any, Any]:
        from loraledger.audit.log import AuditLog
        from loraledger.evidence.log_key import LogKey

        args = self._state.config.engine_args
        if args.audit_url is None:
            raise APIError(404, "this server keeps no audit log (audit_url is off): it has no evidence to serve",
                           code="no_audit_log")  # fmt: skip
        with self._lock:
            if self._log is None:
                self._key = LogKey.load(args.log_key_file, create=True)
                self._log = AuditLog(args.audit_url).open()
        return self._log, self._key

    async def _run(self, work) -> Any:
        timeout = self._state.config.engine_args.audit_timeout
        with anyio.move_on_after(timeout * 4) as scope:
            result = await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        if scope.cancelled_caught:
            raise AuditUnavailableError(f"the audit database did not answer within {timeout * 4:g} s")
        return result

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

    async def checkpoint(self) -> str:
        from loraledger.evidence import log_tree
        from loraledger.store.db import write_transaction

        def sign() -> str:
            log, key = self._opened()
            with write_transaction(log.engine) as conn:
                return log_tree.sign_checkpoint(conn, key)

        return await self._run(sign)

    async def log_key(self) -> str:
        return await self._run(lambda: self._opened()[1].verifier.vkey())

    async def inclusion(self, leaf: int, size: int | None) -> Any:
        from loraledger.evidence import log_tree

        def prove() -> Any:
            log, _ = self._opened()
            with log.snapshot() as conn:
                return log_tree.inclusion(conn, leaf, size)

        return await self._run(prove)

    async def consistency(self, old: int, new: int | None) -> Any:
        from loraledger.evidence import log_tree

        def prove() -> Any:
            log, _ = self._opened()
            with log.snapshot() as conn:
                return log_tree.consistency(conn, old, new)

        return await self._run(prove)

    async def receipt(self, audit_key: str, caller: Caller) -> Any:
        from loraledger.evidence import receipt_store

        def read() -> Any:
            log, _ = self._opened()
            with log.snapshot() as conn:
                return receipt_store.stored(conn, audit_key)

        found = await self._run(read)
        # a key sees the receipts of its own tenant only (an admin key, or a server without keys, sees all)
        if found is not None and caller.tenant is not None and not caller.is_admin:
            if found.fields().get("tenant") != caller.tenant:
                found = None
        if found is None:
            raise APIError(404, f"no receipt for audit key {audit_key!r} that this key may read", code="not_found")
        return found


def bad_request(exc: EvidenceError) -> APIError:
    return APIError(400, str(exc), code="invalid_evidence_request")
