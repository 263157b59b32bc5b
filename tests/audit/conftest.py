"""Fixtures of the audit tests: a migrated database (both dialects) holding a synthetic log."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loraledger.audit import AuditLog
from loraledger.store.audit_store import AuditStore
from tests.audit.synth import SynthLog, build_log

REPORT_KEY = "test-report-key-0123456789"


@pytest.fixture
def synth(migrated_db_url: str) -> SynthLog:
    """60 requests over 5 days written to migrated_db_url through AuditStore.write."""
    with AuditStore(migrated_db_url) as store:
        return build_log(store, n_requests=60, days=5)


@pytest.fixture
def audit_log(migrated_db_url: str, synth: SynthLog) -> Iterator[AuditLog]:
    with AuditLog(migrated_db_url) as log:
        yield log


@pytest.fixture
def report_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("LORALEDGER_REPORT_KEY", REPORT_KEY)
    return {"LORALEDGER_REPORT_KEY": REPORT_KEY}
