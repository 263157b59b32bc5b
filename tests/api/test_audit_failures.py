"""The audit store going down mid-run: finished outputs are held (never lost, never released off the record) and
arrive once it is back, new requests are refused or wait per audit_on_failure, and everything lands exactly once."""

from __future__ import annotations

import threading
import time

import anyio
import msgspec
import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from loraledger import AsyncEngine, EngineArgs, RequestOutputKind, SamplingParams
from loraledger.audit import AuditLog
from loraledger.errors import AuditUnavailableError, ConfigError, LoraLedgerError
from loraledger.store.audit_store import COMPLETIONS, AuditStore
from tests.api.conftest import loras_for, random_prompts
from tests.stress.checks import log_problems
from tests.tcp_proxy import TcpProxy

N_REQUESTS = 6
WAIT_S = 120  # upper bounds only: a few tiny-model steps, unless a shared 2-core machine is oversubscribed


def engine_args(tiny, url: str, policy: str) -> EngineArgs:
    return EngineArgs(
        model=str(tiny.model_dir),
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        block_size=4,
        audit_url=url,
        audit_on_failure=policy,
    )


class Outage:
    """Fault injection on AuditStore: from the first write that carries completions (once armed) until `end()`,
    writes and the admission duplicate check raise AuditUnavailableError, as an unreachable database does."""

    def __init__(self, monkeypatch, cut=None) -> None:
        self.down = False
        self.armed = False
        self.committed: set[str] = set()  # request ids whose completions went through
        self.refused: set[str] = set()  # request ids whose completions (or binding check) failed
        self._cut = cut  # with a real outage: a callable that makes the database unreachable
        self._cond = threading.Condition()
        write, existing = AuditStore.write, AuditStore.existing_request_ids

        def faulty_write(store, batch, **kwargs):
            ids = {c.request_id for c in batch.completions}
            with self._cond:
                if self.armed and ids and not self.down:
                    self.down = True
                    if self._cut is not None:
                        self._cut()
                down = self.down
            try:
                if down and self._cut is None:
                    raise AuditUnavailableError("injected outage: the audit store is unreachable")
                result = write(store, batch, **kwargs)
            except AuditUnavailableError:
                self._note(self.refused, ids | {r.request_id for r in batch.requests})
                raise
            self._note(self.committed, ids)
            return result

        def faulty_existing(store, request_ids):
            request_ids = list(request_ids)
            try:
                if self.down and self._cut is None:
                    raise AuditUnavailableError("injected outage: the audit store is unreachable")
                return existing(store, request_ids)
            except AuditUnavailableError:
                self._note(self.refused, set(request_ids))
                raise

        monkeypatch.setattr(AuditStore, "write", faulty_write)
        monkeypatch.setattr(AuditStore, "existing_request_ids", faulty_existing)

    def _note(self, into: set[str], ids: set[str]) -> None:
        with self._cond:
            into.update(ids)
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self.down = False
            self.armed = False

    async def wait_for(self, predicate, timeout: float = WAIT_S) -> None:
        def wait() -> bool:
            with self._cond:
                return self._cond.wait_for(predicate, timeout)

        assert await anyio.to_thread.run_sync(wait), "the outage never reached the expected state"


# the requests here are submitted with their caller id as their audit key too (submit's audit_id), so the store's
# rows and the callers' outputs are matched by one id
async def run_through_outage(engine: AsyncEngine, outage: Outage, tiny, policy: str, restore=None) -> tuple[dict, str]:
    """Admit N requests, take the store down at the first completion write, check what callers see, bring it back.

    Returns (request id -> final RequestOutput, the id of the request submitted during the outage)."""
    loras = [None, *loras_for(tiny).values()]
    prompts = random_prompts(N_REQUESTS, seed=31)
    ids = [f"outage-{i}" for i in range(N_REQUESTS)]
    params = [
        SamplingParams(n=1 + i % 2, temperature=0.7, seed=i, max_tokens=10 + 2 * i, ignore_eos=True)
        for i in range(N_REQUESTS)
    ]
    finals: dict[str, object] = {}
    late_id = "outage-late"
    late: dict[str, object] = {}

    async def collect(rid: str, channel) -> None:
        async with channel:
            async for delivery in channel:
                if isinstance(delivery.item, BaseException) or delivery.item.finished:
                    finals[rid] = delivery.item
                    return

    async def submit_late() -> None:
        try:
            channel = await engine.submit(
                late_id,
                {"prompt_token_ids": [7, 8, 9]},
                SamplingParams(temperature=0, max_tokens=3),
                loras[1],
                audit_id=late_id,
            )
        except AuditUnavailableError as exc:
            late["error"] = exc
            return
        late["accepted"] = True
        await collect(late_id, channel)

    async with anyio.create_task_group() as tg:
        channels = {}

        async def admit(i: int) -> None:
            channels[ids[i]] = await engine.submit(
                ids[i], {"prompt_token_ids": prompts[i]}, params[i], loras[i % len(loras)], audit_id=ids[i]
            )

        async with anyio.create_task_group() as admissions:
            for i in range(N_REQUESTS):
                admissions.start_soon(admit, i)
        outage.armed = True  # every binding is on record; the next completion write finds the store down
        for rid, channel in channels.items():
            tg.start_soon(collect, rid, channel)

        # wait until every request has finished computing and tried to put its completions on record
        await outage.wait_for(lambda: set(ids) <= outage.committed | outage.refused)
        held = set(ids) - outage.committed
        assert held, "the outage began after every request had committed; nothing was in flight"
        with anyio.move_on_after(0.3):
            while not held & finals.keys():
                await anyio.sleep(0.01)
        assert not held & finals.keys(), "a final output was released while its completions were not on record"

        tg.start_soon(submit_late)
        if policy == "reject":
            with anyio.fail_after(WAIT_S):
                while not late:
                    await anyio.sleep(0.01)
            assert isinstance(late.get("error"), AuditUnavailableError), late
        else:
            await outage.wait_for(lambda: late_id in outage.refused)  # the writer tried, the store was down
            assert late == {}, "with audit_on_failure='block' a new request waits for the store"

        outage.end()
        if restore is not None:
            restore()
        with anyio.fail_after(WAIT_S):
            while len(finals) < len(ids) + (policy == "block"):
                await anyio.sleep(0.01)
    return finals, late_id


def check_everything_once(url: str, finals: dict, late_id: str, policy: str) -> None:
    for rid, out in finals.items():
        assert not isinstance(out, BaseException), f"{rid}: {out!r}"
    released = {rid: len(out.outputs) for rid, out in finals.items()}
    assert set(released) == {f"outage-{i}" for i in range(N_REQUESTS)} | ({late_id} if policy == "block" else set())
    # every released output on record exactly once, nothing half-written, the chain verifies
    assert log_problems(url, set(released), released) == []
    with AuditStore(url) as store:
        assert (late_id in store.existing_request_ids([late_id])) == (policy == "block")
        assert store.unfinished_requests() == []


@pytest.mark.parametrize("policy", ["reject", "block"])
async def test_outputs_are_held_through_an_outage_and_new_requests_follow_the_policy(
    db_url, tiny_llama, monkeypatch, policy
):
    outage = Outage(monkeypatch)
    async with AsyncEngine(engine_args(tiny_llama, db_url, policy)) as engine:
        finals, late_id = await run_through_outage(engine, outage, tiny_llama, policy)
    check_everything_once(db_url, finals, late_id, policy)


@pytest.mark.postgres
async def test_a_real_postgres_outage_through_a_cut_connection(pg_db_url, tiny_llama, monkeypatch):
    url = make_url(pg_db_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    try:
        outage = Outage(monkeypatch, cut=proxy.cut)  # the store's own writes fail for real: no injected errors
        async with AsyncEngine(engine_args(tiny_llama, proxied, "reject")) as engine:
            finals, late_id = await run_through_outage(engine, outage, tiny_llama, "reject", restore=proxy.restore)
    finally:
        proxy.close()
    check_everything_once(pg_db_url, finals, late_id, "reject")


AUDIT_TIMEOUT = 1.0
SHUTDOWN_TIMEOUT = 2.0
PG_CONNECT_FLOOR = 2.0  # libpq waits at least this long for a new connection
SLACK = 3.0  # scheduling on a loaded 2-core machine; the deadlines are what is measured


class WriteAttempts:
    """Notes the request ids whose completions the AuditWriter has tried to write (committed or not)."""

    def __init__(self, monkeypatch) -> None:
        self.ids: set[str] = set()
        self._cond = threading.Condition()
        write = AuditStore.write

        def noting_write(store, batch, **kwargs):
            with self._cond:
                self.ids.update(c.request_id for c in batch.completions)
                self._cond.notify_all()
            return write(store, batch, **kwargs)

        monkeypatch.setattr(AuditStore, "write", noting_write)

    async def wait_for(self, ids: set[str], timeout: float = WAIT_S) -> None:
        def wait() -> bool:
            with self._cond:
                return self._cond.wait_for(lambda: ids <= self.ids, timeout)

        assert await anyio.to_thread.run_sync(wait), f"no completion write was tried for {sorted(ids - self.ids)}"


@pytest.mark.postgres
async def test_a_hung_postgres_refuses_new_requests_within_the_deadline_and_close_is_bounded(
    pg_db_url, tiny_llama, monkeypatch
):
    """A partition (connections open, no answers): new requests are refused within audit_timeout, close() returns
    within shutdown_timeout without releasing outputs that are not on record, and the next start records those
    requests as interrupted."""
    url = make_url(pg_db_url)
    attempts = WriteAttempts(monkeypatch)
    loras = [None, *loras_for(tiny_llama).values()]
    ids = [f"hung-{i}" for i in range(4)]
    outcomes: dict[str, object] = {}

    async def collect(rid: str, channel) -> None:
        outcomes[rid] = "the channel ended without an outcome"
        async with channel:
            async for delivery in channel:
                outcomes[rid] = delivery.item
                if isinstance(delivery.item, BaseException) or delivery.item.finished:
                    return

    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        args = msgspec.structs.replace(
            engine_args(tiny_llama, proxied, "reject"), audit_timeout=AUDIT_TIMEOUT, shutdown_timeout=SHUTDOWN_TIMEOUT
        )
        async with anyio.create_task_group() as tg:
            engine = AsyncEngine(args)
            await engine.__aenter__()
            try:
                # long generations (hundreds of steps): bound and on record in milliseconds, still running when it hangs
                params = SamplingParams(
                    temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
                )
                for i, rid in enumerate(ids):
                    tg.start_soon(
                        collect,
                        rid,
                        await engine.submit(
                            rid, {"prompt_token_ids": [5 + i, 6, 7]}, params, loras[i % len(loras)], audit_id=rid
                        ),
                    )
                proxy.freeze()
                started = time.monotonic()
                with pytest.raises(AuditUnavailableError):
                    await engine.submit(
                        "hung-late", {"prompt_token_ids": [9, 9, 9]}, params, loras[1], audit_id="hung-late"
                    )
                refused_after = time.monotonic() - started
                await attempts.wait_for(set(ids))  # every output computed and tried on record
            finally:
                started = time.monotonic()
                await engine.__aexit__(None, None, None)
                closed_after = time.monotonic() - started
        print(
            f"hung PostgreSQL: new request refused after {refused_after:.2f} s, close() returned after {closed_after:.2f} s"
        )
        assert refused_after < max(AUDIT_TIMEOUT, PG_CONNECT_FLOOR) + SLACK
        assert closed_after < SHUTDOWN_TIMEOUT + AUDIT_TIMEOUT + SLACK
        proxy.thaw()

    with AuditStore(pg_db_url) as store, store.engine.connect() as conn:
        on_record = set(
            conn.execute(select(COMPLETIONS.c.request_id).where(COMPLETIONS.c.request_id.in_(ids))).scalars()
        )
    held = set(ids) - on_record
    assert held, "every output reached the record before the database hung: nothing was in flight"
    for rid in held:  # not on record, so not released: the caller got a typed error instead
        assert isinstance(outcomes[rid], LoraLedgerError), (rid, outcomes[rid])
    restarted = msgspec.structs.replace(args, audit_url=pg_db_url)
    async with AsyncEngine(restarted) as engine:
        assert set(engine.interrupted) == held  # recorded as after a crash
    with AuditStore(pg_db_url) as store:
        assert store.unfinished_requests() == []
        assert store.existing_request_ids([*ids, "hung-late"]) == set(ids)
    with AuditLog(pg_db_url) as log:
        result = log.verify()
    assert result.ok, result.problems


@pytest.mark.parametrize("field", ["audit_timeout", "shutdown_timeout"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "5"])
def test_deadlines_must_be_positive_seconds(field, value):
    with pytest.raises(ConfigError, match=f"{field} must be a number of seconds > 0"):
        EngineArgs(model="x", **{field: value})
