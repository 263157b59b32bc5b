"""Database fixtures for both dialects: fresh empty SQLite and PostgreSQL databases, and migrated ones.

Fixtures (stable; other test modules rely on them):

- `pg_admin_url` (session): a SQLAlchemy URL of a PostgreSQL database on a server where the
  user may CREATE DATABASE. `$LORALEDGER_TEST_PG_URL` if set, else
  `postgresql+psycopg://{postgres,root}@127.0.0.1:5432/test` (trust auth), whichever answers
  first. If none answers it tries to start the local cluster with `pg_ctlcluster`; if there is
  still none the test FAILS (CI's `.ci/run` installs and starts PostgreSQL). Set
  `LORALEDGER_SKIP_PG=1` to skip every PostgreSQL case instead.
- `db_url`: parametrized `sqlite` / `postgres` (ids of the same names; the postgres case carries
  the `postgres` marker): the URL of a brand-new EMPTY database (a SQLite file in tmp_path, or a
  uniquely named PostgreSQL database dropped after the test).
- `migrated_db_url`: `db_url` upgraded to the head revision.
- `audit_store`: an open `AuditStore` on `migrated_db_url`, closed after the test.

Record builders (plain functions, import them): `make_adapter`, `make_request`,
`make_completion`, `sample_batch` (adapters + requests + completions + admitted/finished events
with dedup keys), and the fingerprints `FP_A`, `FP_B`, `BASE_FP`.
"""

from __future__ import annotations

import glob
import os
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence

import psycopg
import pytest
from sqlalchemy.engine import URL, make_url

from loraledger.store.audit_store import AuditStore
from loraledger.store.db import normalize_url
from loraledger.store.migrate import upgrade
from loraledger.store.records import (
    AdapterRecord,
    AuditBatch,
    CompletionRecord,
    EventKind,
    EventRecord,
    RequestRecord,
)

PG_CANDIDATES = (
    "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "postgresql+psycopg://root@127.0.0.1:5432/test",
)
PG_MISSING = (
    "no PostgreSQL server answers at {tried}. CI's .ci/run installs and starts PostgreSQL; locally, "
    "start one (trust auth, database `test`) or point $LORALEDGER_TEST_PG_URL at one, "
    "or set LORALEDGER_SKIP_PG=1 to skip the PostgreSQL cases"
)


def _libpq(url: str | URL) -> str:
    """url as a libpq connection string for psycopg (no SQLAlchemy driver suffix)."""
    return normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(_libpq(url), connect_timeout=3):
            return True
    except psycopg.Error:
        return False


def _start_local_cluster() -> None:
    for version_dir in sorted(glob.glob("/etc/postgresql/*")):
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", os.path.basename(version_dir), "main", "start"],
            capture_output=True,
            timeout=60,
            check=False,
        )


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    if os.environ.get("LORALEDGER_SKIP_PG") == "1":
        pytest.skip("LORALEDGER_SKIP_PG=1: PostgreSQL cases skipped")
    override = os.environ.get("LORALEDGER_TEST_PG_URL")
    candidates = (override,) if override else PG_CANDIDATES
    for attempt in range(2):
        for url in candidates:
            if _answers(url):
                return str(normalize_url(url).render_as_string(hide_password=False))
        if attempt == 0:
            _start_local_cluster()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not any(_answers(u) for u in candidates):
                time.sleep(0.5)
    pytest.fail(PG_MISSING.format(tried=", ".join(candidates)), pytrace=False)


@pytest.fixture
def pg_db_url(pg_admin_url: str) -> Iterator[str]:
    """A brand-new empty PostgreSQL database, dropped after the test."""
    name = f"loraledger_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_libpq(pg_admin_url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(pg_admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(_libpq(pg_admin_url), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    return request.getfixturevalue("pg_db_url")


@pytest.fixture
def migrated_db_url(db_url: str) -> str:
    upgrade(db_url)
    return db_url


@pytest.fixture
def audit_store(migrated_db_url: str) -> Iterator[AuditStore]:
    store = AuditStore(migrated_db_url).open()
    try:
        yield store
    finally:
        store.close()


FP_A = "a" * 64
FP_B = "b" * 64
BASE_FP = "f" * 64
T0 = 1_763_800_000.123456  # a unix time with microseconds


def make_adapter(fingerprint: str = FP_A, name: str = "alpha", int_id: int = 1) -> AdapterRecord:
    return AdapterRecord(
        fingerprint=fingerprint,
        name=name,
        int_id=int_id,
        path=f"/adapters/{name}",
        rank=8,
        alpha=16.0,
        target_modules=["q_proj", "v_proj"],
        base_model_fingerprint=BASE_FP,
        first_seen=T0,
    )


def make_request(
    request_id: str, adapter_fingerprint: str | None = FP_A, *, tenant: str | None = "acme", at: float = T0
) -> RequestRecord:
    lora = adapter_fingerprint is not None
    return RequestRecord(
        request_id=request_id,
        adapter_fingerprint=adapter_fingerprint,
        lora_name="alpha" if lora else None,
        lora_int_id=1 if lora else None,
        lora_path="/adapters/alpha" if lora else None,
        tenant=tenant,
        sampling_params={"temperature": 0.0, "max_tokens": 4, "top_p": 1.0, "stop": ["\n"]},
        prompt_text=f"prompt of {request_id} \u00e9",
        prompt_sha256="c" * 64,
        prompt_token_count=3,
        received_at=at,
        engine_version="0.1.0",
        base_model_fingerprint=BASE_FP,
    )


def make_completion(
    request_id: str, adapter_fingerprint: str | None = FP_A, index: int = 0, at: float = T0
) -> CompletionRecord:
    return CompletionRecord(
        request_id=request_id,
        index=index,
        text=" hello",
        token_ids=[5, 6, 7, 8],
        cumulative_logprob=-1.25,
        finish_reason="length",
        stop_reason=None,
        adapter_fingerprint=adapter_fingerprint,
        prompt_token_count=3,
        generated_token_count=4,
        first_token_at=at + 0.01,
        finished_at=at + 0.02,
    )


def sample_batch(
    request_ids: Sequence[str], adapter_fingerprint: str | None = FP_A, *, finished: bool = True, at: float = T0
) -> AuditBatch:
    """Admission of request_ids (bound to adapter_fingerprint; None = base model) and, if finished,
    one completion each and their request_finished events. Every event has a dedup key."""
    events = [
        EventRecord(
            kind=EventKind.REQUEST_ADMITTED, at=at, request_id=rid, payload={"n": i}, dedup_key=f"admitted:{rid}"
        )
        for i, rid in enumerate(request_ids)
    ]
    completions = []
    if finished:
        completions = [make_completion(rid, adapter_fingerprint, at=at) for rid in request_ids]
        events += [
            EventRecord(
                kind=EventKind.REQUEST_FINISHED,
                at=at + 0.02,
                request_id=rid,
                payload={"reason": "length"},
                dedup_key=f"finished:{rid}",
            )
            for rid in request_ids
        ]
    return AuditBatch(
        adapters=[make_adapter(adapter_fingerprint)] if adapter_fingerprint else [],
        requests=[make_request(rid, adapter_fingerprint, at=at) for rid in request_ids],
        completions=completions,
        events=events,
    )
