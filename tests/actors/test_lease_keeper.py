"""LeaseKeeper: a running engine renews its lease; an engine a peer recovered (its lease had run out) stops, and what
it would still write is refused; a clean stop ends the lease as stopped."""

from __future__ import annotations

import anyio
import pytest
from sqlalchemy import update

from loraledger import AsyncEngine, EngineArgs, SamplingParams
from loraledger.errors import EngineDeadError, InstanceLeaseLostError
from loraledger.store.audit_store import AuditStore
from loraledger.store.instances import LEASES, this_instance
from loraledger.store.models import utc_from_unix

LEASE_S = 1.5


def _args(tiny_llama, url: str) -> EngineArgs:
    return EngineArgs(
        model=str(tiny_llama.model_dir), block_size=4, audit_url=url, audit_timeout=0.5, audit_lease_seconds=LEASE_S
    )


def _lease(url: str, instance_id: str):
    with AuditStore(url) as store:
        return {s.instance.instance_id: s for s in store.lease_states()}[instance_id]


async def test_a_running_engine_renews_its_lease_and_a_clean_stop_ends_it(db_url, tiny_llama):
    async with AsyncEngine(_args(tiny_llama, db_url)) as engine:
        me = engine.instance_id
        first = await anyio.to_thread.run_sync(_lease, db_url, me)
        await anyio.sleep(LEASE_S * 1.5)  # longer than the lease: only renewals keep it live
        later = await anyio.to_thread.run_sync(_lease, db_url, me)
        assert later.state == "live" and later.expires_at > first.expires_at
    assert (await anyio.to_thread.run_sync(_lease, db_url, me)).state == "stopped"


async def test_an_engine_whose_lease_a_peer_recovered_stops_and_writes_nothing_more(db_url, tiny_llama):
    async with AsyncEngine(_args(tiny_llama, db_url)) as engine:
        me = engine.instance_id
        out = [
            o async for o in engine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), "before")
        ]
        assert out[-1].finished

        def stall_and_recover() -> list[str]:
            """What a peer sees when this engine stalls past its lease: the lease ran out; it claims the instance."""
            with AuditStore(db_url) as peer:
                with peer.engine.begin() as conn:
                    conn.execute(update(LEASES).where(LEASES.c.instance_id == me).values(expires_at=utc_from_unix(0)))
                peer.register(this_instance("0.1.0", 60))
                return peer.recover_expired(at_start=False).instances

        assert me in await anyio.to_thread.run_sync(stall_and_recover)
        with anyio.fail_after(10 * LEASE_S):  # the next renewal finds the lease gone: the engine stops
            while not engine.errored:
                await anyio.sleep(0.05)
        assert not engine.is_running and isinstance(engine.dead_error.__cause__, InstanceLeaseLostError)
        with pytest.raises(EngineDeadError, match="lost its lease"):
            await engine.submit("after", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    with AuditStore(db_url) as store:
        assert "after" not in store.existing_request_ids(["before", "after"])
        assert store.first_break() is None
