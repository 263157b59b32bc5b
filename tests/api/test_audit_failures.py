"""The audit store going down mid-run: finished outputs are held (never lost, never released off the record) and
arrive once it is back, new requests are refused or wait per audit_on_failure, and everything lands exactly once."""

from __future__ import annotations

import socket
import threading

import anyio
import pytest
from sqlalchemy.engine import make_url

from loraledger import AsyncEngine, EngineArgs, SamplingParams
from loraledger.errors import AuditUnavailableError
from loraledger.store.audit_store import AuditStore
from tests.api.conftest import loras_for, random_prompts
from tests.stress.checks import log_problems

N_REQUESTS = 6
WAIT_S = 120  # upper bounds only: a few tiny-model steps, unless a shared 2-core machine is oversubscribed


def engine_args(tiny, url: str, policy: str) -> EngineArgs:
    return EngineArgs(model=str(tiny.model_dir), enable_lora=True, max_loras=3, max_lora_rank=16, block_size=4, audit_url=url, audit_on_failure=policy)


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

        def faulty_write(store, batch):
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
                result = write(store, batch)
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
            channel = await engine.submit(late_id, {"prompt_token_ids": [7, 8, 9]}, SamplingParams(temperature=0, max_tokens=3), loras[1])
        except AuditUnavailableError as exc:
            late["error"] = exc
            return
        late["accepted"] = True
        await collect(late_id, channel)

    async with anyio.create_task_group() as tg:
        channels = {}

        async def admit(i: int) -> None:
            channels[ids[i]] = await engine.submit(ids[i], {"prompt_token_ids": prompts[i]}, params[i], loras[i % len(loras)])

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
async def test_outputs_are_held_through_an_outage_and_new_requests_follow_the_policy(db_url, tiny_llama, monkeypatch, policy):
    outage = Outage(monkeypatch)
    async with AsyncEngine(engine_args(tiny_llama, db_url, policy)) as engine:
        finals, late_id = await run_through_outage(engine, outage, tiny_llama, policy)
    check_everything_once(db_url, finals, late_id, policy)


class TcpProxy:
    """A TCP relay on 127.0.0.1 (random port) to a server; cut() drops every connection and refuses new ones until restore()."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._up = True
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._up:
                self._drop(client)
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                self._drop(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        self._drop(src, dst)

    def _drop(self, *socks: socket.socket) -> None:
        for s in socks:
            with self._lock:
                self._open.discard(s)
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv on it
            except OSError:
                pass
            s.close()

    def cut(self) -> None:
        self._up = False
        with self._lock:
            live = list(self._open)
        self._drop(*live)

    def restore(self) -> None:
        self._up = True

    def close(self) -> None:
        self._listener.close()
        self.cut()


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
