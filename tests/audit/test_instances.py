"""Several engine instances in one log: `audit instances` lists them with their leases; requests, usage and reports
filter by instance; verify covers every instance's rows in the one chain."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import update

from loraledger.audit import AuditLog
from loraledger.cli import main
from loraledger.store.audit_store import AuditStore
from loraledger.store.instances import LEASES, this_instance
from tests.audit.synth import build_log


@pytest.fixture
def two_instances(migrated_db_url: str) -> tuple[str, str]:
    """Two engine instances wrote to the log one after the other; the first stopped with requests still pending
    (its lease ends as expired, for a peer to recover them), the second runs."""
    ids = []
    stores = []
    for seed in (1, 2):
        store = AuditStore(migrated_db_url).open()
        ids.append(store.register(this_instance("0.1.0", lease_seconds=600)).instance_id)
        build_log(store, n_requests=12, days=1, seed=seed)
        stores.append(store)
    stores[0].release_lease()
    for store in stores:
        store.close()
    return ids[0], ids[1]


def _jsonl(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    assert main(list(argv)) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_audit_instances_lists_each_instance_with_its_lease(migrated_db_url, two_instances, capsys):
    first, second = two_instances
    rows = _jsonl(capsys, "audit", "instances", "--url", migrated_db_url, "--format", "jsonl")
    assert [(r["instance_id"], r["state"], r["recovered_by"]) for r in rows] == [
        (first, "expired", None),
        (second, "live", None),
    ]
    assert all(r["lease_seconds"] == 600 and r["pid"] > 0 and r["started_at"].endswith("Z") for r in rows)
    assert main(["audit", "instances", "--url", migrated_db_url]) == 0
    table = capsys.readouterr().out
    assert first in table and "expired" in table and "(2 rows)" in table


def test_requests_usage_and_reports_filter_by_instance(migrated_db_url, two_instances, capsys, tmp_path):
    first, second = two_instances
    every = _jsonl(capsys, "audit", "requests", "--url", migrated_db_url, "--format", "jsonl")
    mine = _jsonl(capsys, "audit", "requests", "--url", migrated_db_url, "--format", "jsonl", "--instance", first)
    assert len(every) == 24 and {r["instance_id"] for r in every} == {first, second}
    assert mine == [r for r in every if r["instance_id"] == first] and len(mine) == 12
    usage = _jsonl(
        capsys, "audit", "usage", "--url", migrated_db_url, "--format", "jsonl", "--by", "tenant", "--instance", second
    )
    assert sum(u["requests"] for u in usage) == 12
    assert (
        _jsonl(
            capsys, "audit", "requests", "--url", migrated_db_url, "--format", "jsonl", "--instance", "no-such-instance"
        )
        == []
    )
    out = tmp_path / "report"
    code = main(["audit", "report", "--url", migrated_db_url, "--since", "2026-11-01", "--until", "2026-12-31",
                 "--instance", first, "--out", str(out), "--unsigned"])  # fmt: skip
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["filters"]["instance"] == first and manifest["counts"]["requests"] == 12
    assert manifest["verification"]["ok"]  # verify covers the whole log: every instance's rows
    lines = (out / "requests.csv").read_text().splitlines()
    column = lines[0].split(",").index("instance_id")
    assert {line.split(",")[column] for line in lines[1:]} == {first}


def test_verify_covers_every_instance(migrated_db_url, two_instances):
    with AuditLog(migrated_db_url) as log:
        result = log.verify()
        assert result.ok and result.requests == 24, result.problems
        assert {i.instance.instance_id for i in log.instances()} == set(two_instances)


def test_audit_show_names_the_instance_that_admitted_the_request(migrated_db_url, two_instances, capsys):
    first, second = two_instances
    rows = _jsonl(capsys, "audit", "requests", "--url", migrated_db_url, "--format", "jsonl", "--instance", second)
    key = rows[0]["request_id"]
    assert main(["audit", "show", key, "--url", migrated_db_url]) == 0
    assert f"  instance      {second}" in capsys.readouterr().out
    assert main(["audit", "show", key, "--url", migrated_db_url, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["instance_id"] == second


def test_who_recovered_an_instance_is_checked_against_the_chain(migrated_db_url, two_instances, capsys):
    """`audit instances` shows who recovered an instance from instance_leases, a table that changes in place (no
    guards): the claim is on the chain (the claimer's engine_recovered event lists the instance), and verify holds
    the lease to it, both ways."""
    first, second = two_instances
    with AuditStore(migrated_db_url).open() as me:
        mine = me.register(this_instance("0.1.0", lease_seconds=600)).instance_id
        assert first in me.recover_expired(at_start=False).instances
    rows = _jsonl(capsys, "audit", "instances", "--url", migrated_db_url, "--format", "jsonl")
    assert {r["instance_id"]: (r["state"], r["recovered_by"]) for r in rows}[first] == ("recovered", mine)
    with AuditLog(migrated_db_url) as log:
        assert log.verify().ok

    def forged(instance_id: str, recovered_by: str | None) -> list[str]:
        with AuditStore(migrated_db_url) as store, store.engine.begin() as conn:
            conn.execute(update(LEASES).where(LEASES.c.instance_id == instance_id).values(recovered_by=recovered_by))
        with AuditLog(migrated_db_url) as log:
            result = log.verify()
        return [
            p.message for p in result.problems if p.table == "instance_leases" and p.key == {"instance_id": instance_id}
        ]

    assert any(mine in m and "engine_recovered" in m for m in forged(first, second))  # blamed on another instance
    assert any(mine in m and "engine_recovered" in m for m in forged(first, None))  # the recovery hidden
    assert any(second in m and "engine_recovered" in m for m in forged(mine, second))  # a recovery that never was
    forged(first, mine)
    forged(mine, None)
    with AuditLog(migrated_db_url) as log:
        assert log.verify().ok
