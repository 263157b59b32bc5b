"""Revision 0006 (requests.caller_request_id, requests.chat_template_sha256) on a log written before it: every row
stays valid and verifiable, and a request keyed by its caller's id is found by that id, beside the requests that
reuse it later (vLLM lets a caller reuse an id once its request has finished)."""

from __future__ import annotations

from sqlalchemy import text

from loraledger import LLM, SamplingParams
from loraledger.audit import AuditLog
from loraledger.cli import main
from loraledger.store.db import make_engine
from loraledger.store.migrate import upgrade
from tests.audit.synth import build_log
from tests.store.test_migrate import _StoreAsOf


def test_rows_from_before_0006_verify_after_the_upgrade_and_share_their_id_with_a_later_request(
    db_url, tiny_llama, monkeypatch, capsys
):
    assert upgrade(db_url, "0005_key_id") == "0005_key_id"
    engine = make_engine(db_url)
    synth = build_log(_StoreAsOf(engine, "0005_key_id", monkeypatch), n_requests=6, days=1, key_ids=False)
    engine.dispose()
    upgrade(db_url)
    old = synth.requests[0].binding
    with AuditLog(db_url) as log:
        result = log.verify()
        assert result.ok, result.problems
        assert log.resolve_request_ids(old.request_id) == ([old.request_id], 1)
        binding = log.request(old.request_id).binding
        assert (binding.caller_request_id, binding.chat_template_sha256) == (None, None)

    # a new engine on the upgraded log; a caller reuses the old request's id (its key was that id)
    with LLM(model=str(tiny_llama.model_dir), audit_url=db_url) as llm:
        llm.llm_engine.add_request(old.request_id, "hello", SamplingParams(temperature=0, max_tokens=3))
        while llm.llm_engine.has_unfinished_requests():
            finals = [o for o in llm.llm_engine.step() if o.finished]
    (new,) = finals
    assert new.request_id == old.request_id and new.audit_id != old.request_id

    # its key is that id, and an exact audit key always wins; asked as a caller id, both requests are listed
    assert main(["audit", "show", old.request_id, "--url", db_url]) == 0
    assert f"request {old.request_id}  " in capsys.readouterr().out
    assert main(["audit", "show", old.request_id, "--caller-id", "--url", db_url]) == 0
    shown = capsys.readouterr().out
    assert f"caller request id {old.request_id} was used by 2 requests" in shown
    assert shown.index(f"request {old.request_id} ") < shown.index(f"request {new.audit_id} ")
    assert shown.count(f"caller id     {old.request_id}\n") == 2
    with AuditLog(db_url) as log:
        result = log.verify()
        # listings name an old row's caller id as the view does: its key was the caller's id
        listed = {row.request_id: row.caller_request_id for row in log.requests()}
    assert result.ok, result.problems
    assert listed[old.request_id] == old.request_id and listed[new.audit_id] == old.request_id
    assert all(caller is not None for caller in listed.values())
    # the request_lineage view names both by the caller's id (an old row's key is its caller id)
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            found = conn.execute(
                text("SELECT DISTINCT request_id FROM request_lineage WHERE caller_request_id = :id"),
                {"id": old.request_id},
            ).scalars()
            assert set(found) == {old.request_id, new.audit_id}
    finally:
        engine.dispose()
