"""Where a witness or a receipt's verifier reads a log from: its database, or its server's /evidence routes."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import msgspec

from loraledger.errors import EvidenceError
from loraledger.evidence import log_tree
from loraledger.evidence.proofs import ConsistencyProof, InclusionProof

HTTP_TIMEOUT_S = 30.0
MAX_RESPONSE_BYTES = 1 << 20


class DatabaseSource:
    """A log read straight from its audit database (the latest checkpoint it signed, proofs from its tree)."""

    def __init__(self, url: str):
        from loraledger.audit.log import AuditLog

        self._log = AuditLog(url)

    def __enter__(self) -> DatabaseSource:
        self._log.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self._log.close()

    def checkpoint(self) -> str:
        with self._log.snapshot() as conn:
            note = log_tree.latest_note(conn)
        if note is None:
            raise EvidenceError("the log has signed no checkpoint yet: run `loraledger audit sign-checkpoint` first")
        return note

    def consistency(self, old: int, new: int) -> ConsistencyProof:
        with self._log.snapshot() as conn:
            return log_tree.consistency(conn, old, new)

    def inclusion(self, leaf: int, size: int) -> InclusionProof:
        with self._log.snapshot() as conn:
            return log_tree.inclusion(conn, leaf, size)


class HttpSource:
    """A log served by `loraledger serve` (GET /evidence/...), each request under a deadline."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = HTTP_TIMEOUT_S):
        self._base = base_url.rstrip("/")
        self._key = api_key
        self._timeout = timeout

    def __enter__(self) -> HttpSource:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def _get(self, path: str, **query: int) -> bytes:
        url = f"{self._base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self._key}"} if self._key else {})
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                body = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise EvidenceError(f"GET {url} answered {exc.code}: {exc.read(2000).decode(errors='replace')}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise EvidenceError(f"GET {url} failed: {getattr(exc, 'reason', exc)}") from None
        if len(body) > MAX_RESPONSE_BYTES:
            raise EvidenceError(f"GET {url} answered more than {MAX_RESPONSE_BYTES} bytes")
        return body

    def checkpoint(self) -> str:
        return self._get("/evidence/checkpoint").decode("utf-8", errors="replace")

    def consistency(self, old: int, new: int) -> ConsistencyProof:
        return _decode(self._get("/evidence/proof/consistency", old=old, new=new), ConsistencyProof)

    def inclusion(self, leaf: int, size: int) -> InclusionProof:
        return _decode(self._get("/evidence/proof/inclusion", leaf=leaf, size=size), InclusionProof)


def _decode(body: bytes, kind: Any) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError, json.JSONDecodeError) as exc:
        raise EvidenceError(f"the log's answer is not a {kind.__name__}: {exc}") from None


def open_source(where: str, api_key: str | None = None) -> DatabaseSource | HttpSource:
    """http(s)://...: the server; anything else: a database URL."""
    if where.startswith(("http://", "https://")):
        return HttpSource(where, api_key)
    return DatabaseSource(where)
