"""What the HTTP server hands the engine about its caller ends up on record, covered by verify; and what the
engine tells a server's /metrics (AsyncEngine.get_metrics)."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from loraledger import AsyncEngine, EngineArgs, LoRARequest, SamplingParams
from loraledger.audit import AuditLog
from loraledger.store.audit_store import ADAPTERS, EVENTS, REQUESTS
from loraledger.store.db import make_engine
from loraledger.store.records import EventKind
from tests.audit.tampering import tamper


def _args(tiny, url: str) -> EngineArgs:
    return EngineArgs(
        model=str(tiny.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, audit_url=url
    )


def _rows(url: str, query):
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(query).all()
    finally:
        engine.dispose()


async def test_key_id_caller_and_access_denied_are_on_record_and_verified(tiny_llama, tmp_path):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    sql = LoRARequest("sql", 1, str(tiny_llama.adapters["qv_r4"]))
    rid = "client-7"  # the caller's own id (a server passes the client's X-Request-Id)
    async with AsyncEngine.from_engine_args(_args(tiny_llama, url)) as engine:
        assert await engine.add_lora(sql)
        # on record when add_lora returns, before any request used it
        assert [r.name for r in _rows(url, select(ADAPTERS.c.name))] == ["sql"]
        params = SamplingParams(temperature=0, max_tokens=3)
        async for out in engine.generate("hello", params, rid, sql, tenant="acme", key_id="key-1", user="u-9"):
            pass
        assert out.finished
        assert await engine.record_access_denied(
            tenant="acme", key_id="key-1", adapter="secret", route="/v1/completions"
        )
        metrics = await engine.get_metrics()
    assert metrics.host_loads == {"sql": 1} and metrics.stats.slot_loads == {"sql": 1}
    assert metrics.audit_enabled and metrics.audit_commits >= 2 and metrics.audit_failures == 0
    assert (
        metrics.stats.max_loras == 2
        and metrics.stats.num_requests_running == 0
        and 0 <= metrics.stats.kv_cache_usage <= 1
    )

    [(request_id, caller_id, tenant, key_id)] = _rows(
        url, select(REQUESTS.c.request_id, REQUESTS.c.caller_request_id, REQUESTS.c.tenant, REQUESTS.c.key_id)
    )
    assert (request_id, caller_id, tenant, key_id) == (out.audit_id, "client-7", "acme", "key-1")
    events = _rows(url, select(EVENTS.c.kind, EVENTS.c.request_id, EVENTS.c.payload).order_by(EVENTS.c.seq))
    admitted = next(e for e in events if e.kind == EventKind.REQUEST_ADMITTED)
    assert admitted.payload["caller"] == {"user": "u-9"}
    assert admitted.payload["binding"]["caller_request_id"] == "client-7"
    assert admitted.payload["binding"]["key_id"] == "key-1"
    denied = [e for e in events if e.kind == EventKind.ACCESS_DENIED]
    assert [(e.request_id, e.payload) for e in denied] == [
        (None, {"tenant": "acme", "key_id": "key-1", "adapter": "secret", "route": "/v1/completions"})
    ]
    with AuditLog(url) as log:
        assert log.verify().ok

    # an access_denied event is in the hash chain: its payload edited is found
    tamper(url, "UPDATE events SET payload = :p WHERE kind = 'access_denied'", p='{"tenant": "globex"}')
    with AuditLog(url) as log:
        result = log.verify()
    assert not result.ok and "access_denied" in result.first_problem.message


@pytest.mark.parametrize("field", ["key_id", "user"])
async def test_caller_fields_are_checked_like_the_tenant(tiny_llama, field):
    from loraledger.errors import TenantError

    args = EngineArgs(model=str(tiny_llama.model_dir), block_size=4, audit_url=None)
    async with AsyncEngine.from_engine_args(args) as engine:
        with pytest.raises(TenantError):
            await engine.submit("r", "hi", SamplingParams(max_tokens=1), **{field: "x" * 5000})
