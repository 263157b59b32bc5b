"""A constrained request's binding names its constraint: kind and sha256 always, the canonical text only where
audit_prompts is "text"; the chain verifies, a forged constraint is found, and `audit show` prints it."""

from __future__ import annotations

import hashlib
import json

import pytest
from sqlalchemy import select, text

from loraledger import LLM, SamplingParams
from loraledger.audit import AuditLog
from loraledger.audit.lineage_text import format_lineage
from loraledger.digests import text_commitment
from loraledger.sampling_params import StructuredOutputsParams
from loraledger.store import texts
from loraledger.store.audit_store import REQUESTS, AuditStore
from loraledger.store.guards import guards_for
from loraledger.structured_outputs import canonical_constraint, from_canonical

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize("policy", ["text", "hash"])
def test_the_binding_records_the_constraint_per_audit_prompts(tmp_path, tiny_llama, policy):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    expected = canonical_constraint(so)
    with LLM(model=str(tiny_llama.model_dir), block_size=4, audit_url=url, audit_prompts=policy) as llm:
        outs = llm.generate(
            ["the quick brown fox", "a lazy dog"],
            [
                SamplingParams(temperature=0, max_tokens=16, structured_outputs=so),
                SamplingParams(temperature=0, max_tokens=4),
            ],
            use_tqdm=False,
        )
    assert json.loads(outs[0].outputs[0].text) in ({"ok": True}, {"ok": False})
    with AuditStore(url) as store, store.engine.connect() as conn:
        rows = {r.request_id: r for r in conn.execute(select(REQUESTS))}
    constrained, plain = rows[outs[0].audit_id], rows[outs[1].audit_id]
    assert constrained.constraint_kind == "json"
    assert constrained.constraint_sha256 == expected.sha256 == hashlib.sha256(expected.canonical.encode()).hexdigest()
    # the schema can say as much as a prompt: its text is kept where prompts are, apart under a salt (so it can be
    # erased), never in the binding's row; the parameters never hold it
    assert constrained.constraint_text is None
    with AuditStore(url) as store, store.engine.connect() as conn:
        kept = texts.stored(conn, [outs[0].audit_id]).get((outs[0].audit_id, texts.CONSTRAINT, 0))
    if policy == "text":  # what a resumed request is rebuilt from
        assert kept.text == expected.canonical and kept.token_ids == []
        assert constrained.constraint_commitment == text_commitment(kept.salt, expected.canonical)
        assert canonical_constraint(from_canonical(kept.text)) == expected
    else:
        assert kept is None and constrained.constraint_commitment is None
    assert "structured_outputs" not in constrained.sampling_params
    assert plain.constraint_kind is plain.constraint_sha256 is plain.constraint_commitment is None
    with AuditLog(url) as log:
        assert log.verify().ok
        shown = format_lineage(log.request(outs[0].audit_id))
    assert f"constraint    json, sha256 {expected.sha256}" in shown
    assert (expected.canonical in shown) == (policy == "text")

    # a forged digest (guards out of the way) is found at the row
    with AuditStore(url) as store, store.engine.begin() as conn:
        for guard in guards_for("sqlite"):
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {guard.name}")
        conn.execute(
            text("UPDATE requests SET constraint_sha256 = :h WHERE request_id = :r"),
            {"h": "e" * 64, "r": outs[0].audit_id},
        )
    with AuditLog(url) as log:
        result = log.verify()
    assert not result.ok and "constraint_sha256" in result.first_problem.message
