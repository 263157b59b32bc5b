"""Many engines, one audit log: four engine processes write one database at once, one is killed with SIGKILL mid-load
and a replacement starts. The log stays one verifiable chain, exactly the dead engine's unfinished requests are
recorded as interrupted (by a live instance), the live engines' requests are untouched, every released output is on
record, and each request and event names the instance that wrote it."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from sqlalchemy import select

from loraledger.audit import AuditLog
from loraledger.store.audit_store import EVENTS, REQUESTS, AuditStore
from loraledger.store.migrate import upgrade
from loraledger.store.records import EventKind
from tests.stress.checks import END_KINDS, log_problems
from tests.stress.fleet import FleetRun
from tests.stress.zygote import Zygote, parse_lines, run_argv

# the killed engine ran on this machine, so its peers see its process gone and claim it at their next sweep (a third
# of the lease) without waiting for the lease to run out (that path: tests/store/test_instances.py); the lease and
# the audit_timeout (half of it) leave five processes sharing one SQLite file room to wait for its write lock
LEASE_S = 9.0
ENGINES = 4


@pytest.fixture(scope="module")
def zygote(tiny_llama, tmp_path_factory):
    with Zygote(tiny_llama.model_dir, tmp_path_factory.mktemp("zygote") / "stderr") as z:
        yield z


def _start(zygote, tiny_llama, url, tmp_path, name: str, seed: int, extra: list[str]) -> FleetRun:
    loras = {n: str(p) for n, p in sorted(tiny_llama.adapters.items())[:2]}
    argv = run_argv(
        tiny_llama.model_dir,
        loras,
        url,
        name,
        seed=seed,
        extra=["--lease-seconds", str(LEASE_S), "--max-tokens", "8", *extra],
    )
    return FleetRun(zygote, argv, tmp_path / f"{name}.out")


def _wait_claimed(url: str, instance_id: str, timeout: float) -> str:
    """The instance that recovered instance_id, once one has."""
    deadline = time.monotonic() + timeout
    with AuditStore(url) as store:
        while True:
            state = {s.instance.instance_id: s for s in store.lease_states()}[instance_id]
            if state.recovered_by is not None:
                return state.recovered_by
            assert time.monotonic() < deadline, f"no live instance recovered {instance_id} within {timeout:.0f}s"
            time.sleep(0.1)


def test_four_engines_write_one_log_and_a_replacement_recovers_only_the_killed_one(
    db_url, tiny_llama, zygote, tmp_path
):
    upgrade(db_url)
    runs = {
        f"e{i}": _start(zygote, tiny_llama, db_url, tmp_path, f"e{i}", i, ["--in-flight", "4"]) for i in range(ENGINES)
    }
    ids = {name: run.instance_id for name, run in runs.items()}
    for run in runs.values():  # under load: every engine has released outputs and holds more in flight
        run.expect("RELEASED", 24, timeout=120)
    dead_lines = runs.pop("e1").kill()
    replacement = _start(zygote, tiny_llama, db_url, tmp_path, "e4", 4, ["--in-flight", "4", "--requests", "24"])
    ids["e4"] = replacement.instance_id
    recovered_by = _wait_claimed(db_url, ids["e1"], timeout=4 * LEASE_S + 30)
    replacement.expect("DONE", timeout=90)
    lines = {"e1": dead_lines, "e4": replacement.stop()}
    for name, run in runs.items():
        lines[name] = run.stop()

    admitted: set[str] = set()
    released: dict[str, int] = {}
    for name, run_lines in lines.items():
        a, r, odd = parse_lines(run_lines)
        assert not [o for o in odd if o.startswith("FAILED")], f"{name}: {odd}"
        admitted |= a
        released |= r
    # every released output is on record, nothing half-written, one end event per request, the chain holds
    assert log_problems(db_url, admitted, released) == []
    with AuditLog(db_url) as log:
        result = log.verify()
    assert result.ok, result.problems

    with AuditStore(db_url) as store:
        with store.engine.connect() as conn:
            owner = dict(conn.execute(select(REQUESTS.c.request_id, REQUESTS.c.instance_id)).all())  # by audit key
            caller_owner = dict(conn.execute(select(REQUESTS.c.caller_request_id, REQUESTS.c.instance_id)).all())
            ends = conn.execute(
                select(EVENTS.c.kind, EVENTS.c.request_id, EVENTS.c.instance_id).where(
                    EVENTS.c.kind.in_((*END_KINDS, EventKind.REQUEST_INTERRUPTED))
                )
            ).all()
            writers = set(conn.execute(select(EVENTS.c.instance_id).distinct()).scalars())
        states = {s.instance.instance_id: s.state for s in store.lease_states()}
    by_name = {iid: name for name, iid in ids.items()}
    # each request names the instance that admitted it (its caller id's prefix is the engine's name)
    assert len(caller_owner) == len(owner)
    assert {cid: by_name[iid] for cid, iid in caller_owner.items()} == {cid: cid.split("-")[0] for cid in caller_owner}
    assert writers == set(ids.values()), (writers, ids)  # every event was written by one of the five instances
    interrupted = Counter(rid for kind, rid, _ in ends if kind == EventKind.REQUEST_INTERRUPTED)
    ended = {rid for kind, rid, _ in ends if kind != EventKind.REQUEST_INTERRUPTED}
    dead_unfinished = {rid for rid, iid in owner.items() if iid == ids["e1"]} - ended
    assert set(interrupted) == dead_unfinished and set(interrupted.values()) <= {1}, (
        sorted(interrupted),
        sorted(dead_unfinished),
        states,
    )
    assert dead_unfinished, "the kill landed after the dead engine's last request ended: nothing was in flight"
    # recorded by the live instance that claimed the dead one, never by the dead one itself
    assert {iid for kind, _, iid in ends if kind == EventKind.REQUEST_INTERRUPTED} == {recovered_by} != {ids["e1"]}
    # the live engines' requests are untouched: all ended on their own
    untouched = sorted(rid for rid, iid in owner.items() if iid != ids["e1"] and rid not in ended)
    assert untouched == [], (untouched, states)
    assert states == {iid: ("recovered" if name == "e1" else "stopped") for name, iid in ids.items()}
    assert len(admitted) >= ENGINES * 24 + 24, len(admitted)  # each step above has its own deadline
