"""Erasure: `audit erase` makes prompt and completion text unrecoverable, on record, while verify still passes.

An engine writes text-mode prompts and completions; erasure by tenant, by request and by date (refused inside
the minimum retention unless forced with a reason) deletes their `request_texts` rows through the one guarded
path; bindings, token counts and receipts stay checkable, readers say "erased", and verify catches text that does
not match its commitment, text gone without an erasure, and an erased event that does not match what is gone.
"""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import delete, func, insert, select, text, update
from sqlalchemy import exc as sa_exc

from loraledger import LLM, SamplingParams
from loraledger.audit.erase import erase
from loraledger.audit.log import AuditLog
from loraledger.audit.verify import verify_log
from loraledger.digests import erased_requests_digest, text_commitment
from loraledger.errors import ConfigError
from loraledger.evidence import receipt
from loraledger.evidence.receipt import Receipt
from loraledger.store.db import make_engine, write_transaction
from loraledger.store.models import Erasure, Event, Request, RequestText
from loraledger.store.records import EventKind
from tests.api.test_audit_engine import engine_kwargs
from tests.audit.test_verify_columns import unguarded
from tests.evidence.test_commands import run

T, X, R, E = RequestText.__table__, Erasure.__table__, Request.__table__, Event.__table__
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture
def served(db_url, tiny_llama, tmp_path):
    """Two tenants' text-mode requests (acme: two prompts, n=2 each; bob: one), written by the engine."""
    from loraledger.audit.signing import generate_ed25519_key

    generate_ed25519_key(tmp_path / "log.pem")
    with LLM(**engine_kwargs(tiny_llama, db_url, log_key_file=str(tmp_path / "log.pem"))) as llm:
        acme = llm.generate(["my name is Ada", "I live at 1 Main St"], SamplingParams(n=2, max_tokens=5, seed=1,
                            temperature=0.8, ignore_eos=True), tenant="acme")  # fmt: skip
        bob = llm.generate(["bob's secret"], GREEDY, tenant="bob")
    return db_url, acme, bob


def _texts(url: str) -> dict:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return {(r.request_id, r.part, r.idx): r for r in conn.execute(select(T))}
    finally:
        engine.dispose()


def _verify(url: str):
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return verify_log(conn)
    finally:
        engine.dispose()


def test_erasing_a_tenant_keeps_the_log_verifiable_and_receipts_provable(served, capsys, tmp_path):
    url, acme, bob = served
    before = _texts(url)
    assert len(before) == 2 * 3 + 2  # a prompt and n completions per request
    assert _verify(url).ok

    code, out = run(capsys, "audit", "erase", "--tenant", "acme", "--reason", "GDPR Art. 17 request", "--by", "dpo",
                    "--url", url)  # fmt: skip
    assert code == 0, out
    assert "erased the text of 2 request(s): 2 prompt(s), 4 completion(s), 6 text row(s) deleted" in out
    left = _texts(url)
    assert {k[0] for k in left} == {bob[0].audit_id}  # bob's text is untouched
    # the text is nowhere in the database any more, not in the chain, the receipts or the views
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            dump = json.dumps([list(map(str, row)) for t in ("requests", "completions", "events", "receipts",
                              "request_texts", "request_lineage") for row in conn.execute(text(f"SELECT * FROM {t}"))])  # fmt: skip
            (event,) = conn.execute(select(E).where(E.c.kind == EventKind.ERASED)).all()
            erased = set(conn.execute(select(X.c.request_id)).scalars())
            lineage = conn.execute(text("SELECT text, text_erased FROM request_lineage WHERE tenant = 'acme'")).all()
    finally:
        engine.dispose()
    for out_ in acme:
        assert "Ada" not in dump and "Main St" not in dump
        for c in out_.outputs:
            assert c.text not in dump or c.text == ""
    assert erased == {o.audit_id for o in acme}
    payload = event.payload
    assert (payload["by"], payload["reason"], payload["forced"]) == ("dpo", "GDPR Art. 17 request", False)
    assert payload["selector"]["tenant"] == "acme"
    assert (payload["requests"], payload["prompts"], payload["completions"]) == (2, 2, 4)
    assert payload["requests_sha256"] == erased_requests_digest(o.audit_id for o in acme)
    assert lineage and all(row == (None, 1) for row in lineage)

    result = _verify(url)
    assert result.ok, result.problems
    assert result.erased_texts == 6
    code, out = run(capsys, "audit", "verify", "--url", url)
    assert code == 0 and "6 text rows erased, each on record" in out

    # readers say so
    code, out = run(capsys, "audit", "show", acme[0].audit_id, "--url", url)
    assert code == 0 and f"(erased, event {event.seq})" in out and "Ada" not in out
    code, out = run(capsys, "audit", "show", bob[0].audit_id, "--url", url)
    assert code == 0 and "bob's secret" in out and "erased" not in out
    report = tmp_path / "report"
    code, out = run(capsys, "audit", "report", "--since", "2020-01-01", "--until", "2100-01-01", "--out", str(report),
                    "--format", "jsonl", "--unsigned", "--url", url)  # fmt: skip
    assert code == 0, out
    exported = (report / "requests.jsonl").read_text() + (report / "completions.jsonl").read_text()
    assert "Ada" not in exported and "bob's secret" in exported and bob[0].outputs[0].text in exported

    # the receipt holder still proves its text: the receipt is unchanged and names the text's digest
    held = Receipt(**acme[0].receipt)
    (tmp_path / "r.json").write_bytes(receipt.dumps(held))
    (tmp_path / "text.txt").write_text(acme[0].outputs[0].text, encoding="utf-8")
    code, out = run(capsys, "audit", "verify-receipt", str(tmp_path / "r.json"), "--text", str(tmp_path / "text.txt"))
    assert code == 0 and "text OK" in out, out
    code, out = run(capsys, "audit", "receipt", acme[0].audit_id, "--url", url)
    assert code == 0 and receipt.load(out) == held

    # a second erasure of the same tenant finds nothing left, and records nothing
    code, out = run(capsys, "audit", "erase", "--tenant", "acme", "--url", url)
    assert code == 0 and "nothing to erase" in out
    assert _verify(url).ok


def test_the_guards_let_text_go_only_with_an_erasure_on_record(served):
    url, acme, bob = served
    engine = make_engine(url)
    try:
        rid = acme[0].audit_id
        with pytest.raises(sa_exc.IntegrityError, match="append-only"):
            with engine.begin() as conn:
                conn.execute(delete(T).where(T.c.request_id == rid))
        # an erasures row naming an event that is no erased event does not open the path
        with pytest.raises(sa_exc.IntegrityError, match="append-only"):
            with engine.begin() as conn:
                conn.execute(insert(X), [{"request_id": rid, "seq": 1}])
                conn.execute(delete(T).where(T.c.request_id == rid))
        with pytest.raises(sa_exc.IntegrityError, match="append-only"):
            with engine.begin() as conn:
                conn.execute(update(T).where(T.c.request_id == rid).values(text="forged"))
        with write_transaction(engine) as conn:
            erase(conn, request_id=rid, reason="asked")
        # once erased, its erasure row and event are as append-only as the rest
        for sql in (delete(X), update(X).values(seq=1), delete(E).where(E.c.kind == EventKind.ERASED)):
            with pytest.raises(sa_exc.IntegrityError, match="append-only"):
                with engine.begin() as conn:
                    conn.execute(sql)
    finally:
        engine.dispose()
    assert _verify(url).ok


def test_before_refuses_the_minimum_retention_unless_forced_with_a_reason(served, capsys):
    url, acme, bob = served
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))
    code, out = run(capsys, "audit", "erase", "--before", now, "--url", url)
    assert code != 0 and "inside the minimum retention of 183 days" in out and "--force" in out
    code, out = run(capsys, "audit", "erase", "--before", now, "--force", "--url", url)
    assert code != 0 and "--force needs --reason" in out
    assert len(_texts(url)) == 8  # nothing went
    # a date before every request: nothing to erase, and allowed
    code, out = run(capsys, "audit", "erase", "--before", "2020-01-01", "--url", url)
    assert code == 0 and "nothing to erase" in out
    # a shorter policy lets it through without force (a date past every request, not in the future)
    time.sleep(1.1)
    past = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time()))
    code, out = run(capsys, "audit", "erase", "--before", past, "--keep-days", "0", "--url", url)
    assert code == 0 and "3 request(s)" in out
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            (event,) = conn.execute(select(E.c.payload).where(E.c.kind == EventKind.ERASED)).scalars()
    finally:
        engine.dispose()
    assert event["forced"] is False and event["keep_days"] == 0
    assert _texts(url) == {} and _verify(url).ok


def test_a_forced_erasure_puts_its_reason_on_record(served, capsys):
    url, acme, bob = served
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))
    code, out = run(capsys, "audit", "erase", "--before", now, "--force", "--reason", "court order 12/3", "--url", url)
    assert code == 0, out
    with AuditLog(url) as log, log.snapshot() as conn:
        (payload,) = conn.execute(select(E.c.payload).where(E.c.kind == EventKind.ERASED)).scalars()
    assert payload["forced"] is True and payload["reason"] == "court order 12/3"
    assert _verify(url).ok


def test_erase_refuses_bad_selectors(served):
    url, acme, bob = served
    engine = make_engine(url)
    try:
        with write_transaction(engine) as conn:
            with pytest.raises(ConfigError, match="exactly one of"):
                erase(conn, tenant="acme", request_id=acme[0].audit_id)
            with pytest.raises(ConfigError, match="no request"):
                erase(conn, request_id="not-a-key")
    finally:
        engine.dispose()


# -- tampering ------------------------------------------------------------------------------------------------


def _problems(url: str, edit) -> list[str]:
    engine = make_engine(url)
    try:
        with unguarded(engine) as conn:
            edit(conn)
            result = verify_log(conn)
    finally:
        engine.dispose()
    assert not result.ok
    return [p.message for p in result.problems]


def test_verify_catches_text_that_does_not_match_its_commitment(served):
    url, acme, bob = served
    rid = bob[0].audit_id
    found = _problems(url, lambda c: c.execute(update(T).where(T.c.request_id == rid, T.c.part == "prompt").values(
        text="a different prompt")))  # fmt: skip
    assert any("the text of the prompt" in m and "does not match its commitment" in m for m in found), found
    # the salt too: a text row with another salt no longer opens its commitment
    found = _problems(url, lambda c: c.execute(update(T).where(T.c.request_id == rid, T.c.part == "completion").values(
        salt="00" * 16)))  # fmt: skip
    assert any("completion 0" in m and "does not match its commitment" in m for m in found), found
    # nor may the text sit in the chain-covered row beside its commitment
    found = _problems(url, lambda c: c.execute(update(Request.__table__).where(R.c.request_id == rid).values(
        prompt_text="bob's secret")))  # fmt: skip
    assert any("beside a salted commitment" in m for m in found), found


def test_verify_catches_text_gone_without_an_erasure(served):
    url, acme, bob = served
    rid = bob[0].audit_id
    found = _problems(url, lambda c: c.execute(delete(T).where(T.c.request_id == rid)))
    assert any("missing from `request_texts`, and no erasure of it is on record" in m for m in found), found


def test_verify_catches_an_erased_event_that_does_not_match_what_is_gone(served):
    url, acme, bob = served
    engine = make_engine(url)
    try:
        with write_transaction(engine) as conn:
            erase(conn, tenant="acme", reason="asked")
    finally:
        engine.dispose()
    assert _verify(url).ok
    bob_id = bob[0].audit_id

    def widen(conn) -> None:  # bob's text removed under acme's erasure, which never named it
        seq = conn.execute(select(func.max(X.c.seq))).scalar_one()
        conn.execute(insert(X), [{"request_id": bob_id, "seq": seq}])
        conn.execute(delete(T).where(T.c.request_id == bob_id))

    found = _problems(url, widen)
    assert any("names 2 requests, but the `erasures` rows naming it are 3" in m for m in found), found

    def forget(conn) -> None:  # an erasure row dropped: its request's text is gone with nothing on record
        conn.execute(delete(X).where(X.c.request_id == acme[0].audit_id))

    found = _problems(url, forget)
    assert any("no erasure of it is on record" in m for m in found), found

    def restore(conn) -> None:  # text put back after its erasure (the erasure would be a lie)
        conn.execute(insert(T), [{"request_id": acme[0].audit_id, "part": "prompt", "idx": 0, "salt": "00" * 16,
                                  "text": "x", "token_ids": [1]}])  # fmt: skip

    found = _problems(url, restore)
    assert any("was erased (event" in m and "still in `request_texts`" in m for m in found), found


def test_commitments_open_with_the_kept_salt(served):
    url, acme, bob = served
    kept = _texts(url)
    row = kept[(bob[0].audit_id, "completion", 0)]
    assert row.text == bob[0].outputs[0].text
    assert len(row.salt) == 32 and text_commitment(row.salt, row.text) != text_commitment("00" * 16, row.text)


def test_a_request_still_running_is_not_erased(db_url):
    """Its completions would be written after the erasure: only ended requests are erased."""
    import msgspec

    from loraledger.store.audit_store import AuditStore
    from tests.audit.salted import salted_batch

    with AuditStore(db_url) as store:
        made = salted_batch("running-1", at=time.time(), tenant="t")
        store.write(msgspec.structs.replace(made, completions=[], events=made.events[:1], texts=made.texts[:1]))
        with write_transaction(store.engine) as conn:
            done = erase(conn, request_id="running-1", reason="asked")
    assert done.seq is None and done.requests == 0
    assert len(_texts(db_url)) == 1
