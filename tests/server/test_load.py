"""`loraledger serve` in a process of its own under load (loopback only, bounded): 200 concurrent streaming clients over
several adapters and tenants, some leaving early; then SIGTERM in the middle of a second wave. Everything released is
on record under the right tenant, the rest is on record as aborted, the process exits 0, and the log verifies."""

from __future__ import annotations

import json
import random
import signal
import time

import anyio
import httpx
from sqlalchemy import select

from loraledger.audit import AuditLog
from loraledger.server.auth import add_key
from loraledger.store.audit_store import EVENTS, REQUESTS
from loraledger.store.records import EventKind
from tests.server.audit_rows import completions, query
from tests.server.live import ServerProcess

# tenant -> models its key may use (the base model is served as "tiny")
TENANTS = {
    "acme": ["tiny", "qv_r4"],
    "globex": ["all_r8", "ogd_r16_rslora"],
    "initech": ["*"],
    "umbrella": ["qv_r4", "ogd_r16_rslora"],
}
MODELS = ["tiny", "qv_r4", "all_r8", "ogd_r16_rslora"]


async def stream_one(
    http: httpx.AsyncClient, url: str, key: str, model: str, max_tokens: int, leave_after: int | None, started=None
) -> dict:
    """One streaming completion; leave_after: close the connection after that many chunks. Returns what the client saw."""
    body = {"model": model, "prompt": f"story {random.random()}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.8, "stream_options": {"include_usage": True}}  # fmt: skip
    seen = {"id": None, "text": "", "finish": None, "done": False, "chunks": 0, "status": None, "tokens": None}
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        seen["status"] = r.status_code
        if r.status_code != 200:
            return seen
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                seen["done"] = True
                break
            chunk = json.loads(line[6:])
            seen["id"] = chunk["id"]
            if chunk.get("usage"):
                seen["tokens"] = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                seen["text"] += choice["text"]
                seen["finish"] = choice["finish_reason"] or seen["finish"]
            seen["chunks"] += 1
            if started is not None and seen["chunks"] == 1:
                started()
            if leave_after is not None and seen["chunks"] >= leave_after:
                break
    return seen


async def test_200_streaming_clients_then_sigterm_lose_nothing_released(tiny_llama, tmp_path):
    keys_file = tmp_path / "keys.toml"
    keys = {tenant: add_key(keys_file, tenant=tenant, adapters=models) for tenant, models in TENANTS.items()}
    url_db = f"sqlite:///{tmp_path / 'audit.db'}"
    modules = [f"{name}={tiny_llama.adapters[name]}" for name in ("qv_r4", "all_r8", "ogd_r16_rslora")]
    args = [str(tiny_llama.model_dir), "--served-model-name", "tiny", "--lora-modules", *modules, "--max-loras", "2",
            "--max-lora-rank", "16", "--block-size", "4", "--max-num-seqs", "64", "--api-keys", str(keys_file),
            "--audit-url", url_db, "--shutdown-grace", "0.3", "--num-threads", "1", "--log-level", "info",
            "--max-connections-per-client", "300"]  # fmt: skip
    rng = random.Random(3)
    with ServerProcess(args, log=tmp_path / "server.log") as server:
        url = server.base_url
        # SIGHUP: a key added to the file is taken without a restart
        _, late_key = add_key(keys_file, tenant="late", adapters=["tiny"])
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {late_key}"}).status_code != 200:
            assert time.monotonic() < deadline, "SIGHUP did not reload the keys file"
            await anyio.sleep(0.1)

        # wave 1: 200 concurrent streams, one in five leaving after its second chunk (those ask for 240 tokens, so
        # they are still generating when the server learns they left: a 24-token one could finish first)
        plan = []
        for i in range(200):
            tenant = list(TENANTS)[i % len(TENANTS)]
            allowed = [m for m in MODELS if any(p == "*" or p == m for p in TENANTS[tenant])]
            plan.append((tenant, rng.choice(allowed), 2 if i % 5 == 0 else None))
        results: list[dict | None] = [None] * len(plan)
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:

            async def run(i: int) -> None:
                tenant, model, leave = plan[i]
                results[i] = {
                    **await stream_one(http, url, keys[tenant][1], model, 24 if leave is None else 240, leave),
                    "tenant": tenant,
                    "model": model,
                }

            with anyio.fail_after(240):
                async with anyio.create_task_group() as tg:
                    for i in range(len(plan)):
                        tg.start_soon(run, i)
        assert all(r["status"] == 200 for r in results), {r["status"] for r in results}
        finished = [r for r in results if r["done"]]
        left = [r for r in results if not r["done"]]
        assert len(finished) == 160 and len(left) == 40

        # wave 2: long streams; SIGTERM once all are running, with a grace period shorter than they take
        long_results: list[dict] = []
        running = anyio.Event()
        count = {"n": 0}

        def one_started() -> None:
            count["n"] += 1
            if count["n"] == 24:
                running.set()

        async with httpx.AsyncClient(timeout=120, limits=limits) as http:

            async def run_long(i: int) -> None:
                tenant = list(TENANTS)[i % len(TENANTS)]
                model = "qv_r4" if tenant != "globex" else "all_r8"
                try:
                    seen = await stream_one(
                        http, url, keys[tenant][1], model, 3 if i % 3 == 0 else 240, None, one_started
                    )
                except httpx.HTTPError:  # the server closed the connection at the end of the grace period
                    seen = {"id": None, "done": False}
                long_results.append({**seen, "tenant": tenant})

            with anyio.fail_after(180):
                async with anyio.create_task_group() as tg:
                    for i in range(24):
                        tg.start_soon(run_long, i)
                    await running.wait()
                    server.proc.send_signal(signal.SIGTERM)
                    code = await anyio.to_thread.run_sync(lambda: server.proc.wait(timeout=120))
        assert code == 0, (tmp_path / "server.log").read_text()[-3000:]
        log_text = (tmp_path / "server.log").read_text()

    # every line the server logged is JSON with the request id, tenant and adapter keys
    lines = [json.loads(line) for line in log_text.splitlines() if line.startswith("{")]
    assert lines and all({"request_id", "tenant", "adapter"} <= set(line) for line in lines)
    assert any(line.get("logger") == "uvicorn.access" or "HTTP/1.1" in str(line.get("event")) for line in lines)

    on_record = {r.request_id: r for r in query(url_db, select(REQUESTS))}
    ends = {}
    for e in query(url_db, select(EVENTS).where(EVENTS.c.kind.in_(EventKind.TERMINAL))):
        ends[e.request_id] = e.kind
    released = [r for r in finished + long_results if r.get("done")]
    assert len(released) >= 160 + 8  # the short streams of wave 2 finish (within the grace period at the latest)
    for r in released:  # nothing released is missing from the log, under the caller's tenant
        row = on_record[r["id"]]
        assert row.tenant == r["tenant"] and row.key_id == keys[r["tenant"]][0]
        assert ends[r["id"]] == EventKind.REQUEST_FINISHED
        [record] = completions(url_db, r["id"])
        assert record.generated_token_count == r["tokens"]
        if (
            "\ufffd" not in record.text
        ):  # text that is not valid UTF-8 may be split into U+FFFD differently as it streams
            assert record.text == r["text"]
    for r in left:
        assert ends[r["id"]] == EventKind.REQUEST_ABORTED and on_record[r["id"]].tenant == r["tenant"]
    cut = [r for r in long_results if not r.get("done")]
    assert cut, "some long streams should have been running at SIGTERM past the grace period"
    for r in cut:
        if r.get("id") is not None:
            assert ends[r["id"]] == EventKind.REQUEST_ABORTED
    assert set(ends.values()) <= {EventKind.REQUEST_FINISHED, EventKind.REQUEST_ABORTED}  # nothing interrupted
    assert set(on_record) == set(ends)  # every admitted request has its end on record
    with AuditLog(url_db) as log:
        result = log.verify()
    assert result.ok, result.problems
