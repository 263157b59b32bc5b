"""The Merkle tree kept with the log: built with every write, proofs that verify, receipts, and a witness that
catches a rewritten tail."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select

from loraledger.errors import EvidenceError
from loraledger.evidence import log_tree, node_store, receipt, receipt_store
from loraledger.evidence import tree_hash as th
from loraledger.evidence.log_key import LogKey
from loraledger.evidence.proofs import check_consistency, check_inclusion, decode
from loraledger.evidence.tlog_checkpoint import open_checkpoint
from loraledger.evidence.witness import Witness, check_cosigned
from loraledger.store.audit_store import EVENTS, AuditStore
from loraledger.store.db import make_engine
from tests.db_fixtures import sample_batch
from tests.evidence.rewrite import rewrite_tail
from tests.evidence.test_tree_hash import mth


def _event_hashes(store: AuditStore) -> list[bytes]:
    with store.engine.connect() as conn:
        return [bytes.fromhex(h) for h in conn.execute(select(EVENTS.c.hash).order_by(EVENTS.c.seq)).scalars()]


@pytest.fixture
def log_key() -> LogKey:
    return LogKey(Ed25519PrivateKey.generate(), "test.example/log")


def test_the_tree_has_one_leaf_per_event_and_proves_them(audit_store: AuditStore) -> None:
    for i in range(7):
        audit_store.write(sample_batch([f"r{i}a", f"r{i}b"], finished=i % 2 == 0))
    entries = _event_hashes(audit_store)
    with audit_store.engine.connect() as conn:
        n = node_store.size(conn)
        assert n == len(entries)
        assert node_store.root(conn, n) == mth(entries)
        for size in (1, 2, 5, n):
            assert node_store.root(conn, size) == mth(entries[:size])
            for index in range(size):
                proof = node_store.inclusion_proof(conn, index, size)
                assert th.verify_inclusion(th.leaf_hash(entries[index]), index, size, proof, mth(entries[:size]))
        for old in range(1, n + 1):
            proof = node_store.consistency_proof(conn, old, n)
            assert th.verify_consistency(old, mth(entries[:old]), n, mth(entries), proof)


def test_backfill_builds_the_same_tree(audit_store: AuditStore, tmp_path) -> None:
    for i in range(5):
        audit_store.write(sample_batch([f"q{i}"]))
    with audit_store.engine.connect() as conn:
        live = conn.execute(select(node_store.NODES).order_by(node_store.NODES.c.level, node_store.NODES.c.idx)).all()
    # rebuilt in small batches, so the resume from stored nodes is exercised
    engine = make_engine(audit_store.url)
    with engine.begin() as conn:
        for guard in ("merkle_nodes_no_delete",):
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {guard}")
            else:
                conn.exec_driver_sql(f"ALTER TABLE merkle_nodes DISABLE TRIGGER {guard}")
        conn.execute(node_store.NODES.delete())
        assert node_store.backfill(conn, batch=3) == len(_event_hashes(audit_store))
        rebuilt = conn.execute(
            select(node_store.NODES).order_by(node_store.NODES.c.level, node_store.NODES.c.idx)
        ).all()
    engine.dispose()
    assert rebuilt == live


def test_receipts_are_signed_kept_and_lead_to_a_checkpoint(audit_store: AuditStore, log_key: LogKey) -> None:
    audit_store.log_key = log_key
    got: dict = {}
    audit_store.write(sample_batch(["a1", "a2"], finished=False), got)
    assert got == {}  # nothing finished: no receipt
    audit_store.write(sample_batch(["b1", "b2"]), got)
    assert sorted(got) == ["b1", "b2"]
    body = receipt.check_signature(got["b1"], log_key.verifier)
    assert body["audit_key"] == "b1" and body["tenant"] == "acme" and body["adapter_fingerprint"] == "a" * 64
    assert receipt.matching_completion(body, " hello") == 0 and receipt.matching_completion(body, "other") is None
    assert body["completions"][0]["token_ids_sha256"] == receipt.token_ids_sha256([5, 6, 7, 8])
    with audit_store.engine.begin() as conn:
        assert receipt_store.stored(conn, "b1") == got["b1"]
        note = log_tree.sign_checkpoint(conn, log_key)
        checkpoint, _ = open_checkpoint(note, log_key.verifier)
        proof = log_tree.inclusion(conn, body["leaf_index"], checkpoint.size)
    check_inclusion(node_store.leaf_of_event(body["event_hash"]), proof, checkpoint)
    with pytest.raises(EvidenceError, match="not in the checkpoint"):
        check_inclusion(node_store.leaf_of_event("0" * 64), proof, checkpoint)
    # an edited receipt no longer verifies
    forged = receipt.Receipt(body=got["b1"].body.replace('"acme"', '"evil"'), signature=got["b1"].signature,
                             log_key=got["b1"].log_key)  # fmt: skip
    with pytest.raises(EvidenceError, match="signature does not verify"):
        receipt.check_signature(forged)
    other = LogKey(Ed25519PrivateKey.generate(), "test.example/log")
    with pytest.raises(EvidenceError, match="not by the trusted log key"):
        receipt.check_signature(got["b1"], other.verifier)


def test_the_witness_cosigns_growth_and_refuses_a_rewritten_tail(
    audit_store: AuditStore, log_key: LogKey, tmp_path
) -> None:
    wkey = Ed25519PrivateKey.generate()
    witness = Witness("witness.example/w", wkey, tmp_path / "witness.json")

    def consistency(old: int, new: int):
        with audit_store.engine.connect() as conn:
            return log_tree.consistency(conn, old, new)

    def checkpoint_now() -> str:
        with audit_store.engine.begin() as conn:
            return log_tree.sign_checkpoint(conn, log_key)

    audit_store.write(sample_batch(["c1", "c2"]))
    first = witness.cosign(checkpoint_now(), log_key.verifier, consistency, now=1_800_000_000)
    audit_store.write(sample_batch(["c3"], finished=False))
    second = witness.cosign(checkpoint_now(), log_key.verifier, consistency)
    assert check_cosigned(second, log_key.verifier, [witness.verifier]).size == 6
    assert check_cosigned(first, log_key.verifier, [witness.verifier]).size == 5
    # the same checkpoint again is fine (nothing new)
    witness.cosign(second, log_key.verifier, consistency)

    # the owner rewrites the tail after event 4 (guards dropped, chain and tree recomputed), then grows the log
    rewrite_tail(audit_store.url, 4, sample_batch(["c2-rewritten", "c4", "c5"]))
    rewritten = checkpoint_now()
    with pytest.raises(EvidenceError, match="rewritten"):
        witness.cosign(rewritten, log_key.verifier, consistency)
    # and anyone holding the cosigned checkpoint catches it too
    held, _ = open_checkpoint(second, log_key.verifier)
    now, _ = open_checkpoint(rewritten, log_key.verifier)
    with pytest.raises(EvidenceError, match="rewritten"):
        check_consistency(held, now, consistency(held.size, now.size))
    assert witness.last(log_key.origin).size == 6  # the refused checkpoint left the witness's state alone


def test_a_shrunk_log_is_refused(audit_store: AuditStore, log_key: LogKey, tmp_path) -> None:
    witness = Witness("w", Ed25519PrivateKey.generate(), tmp_path / "w.json")
    audit_store.write(sample_batch(["d1", "d2", "d3"]))
    with audit_store.engine.begin() as conn:
        big = log_tree.sign_checkpoint(conn, log_key)
    witness.cosign(big, log_key.verifier, lambda a, b: None)  # first sight: nothing to compare
    rewrite_tail(audit_store.url, 2, sample_batch([], finished=False))
    with audit_store.engine.begin() as conn:
        small = log_tree.sign_checkpoint(conn, log_key)
    with pytest.raises(EvidenceError, match="shrank"):
        witness.cosign(small, log_key.verifier, lambda a, b: None)


def test_proof_requests_out_of_range_are_typed_errors(audit_store: AuditStore) -> None:
    audit_store.write(sample_batch(["e1"]))
    with audit_store.engine.connect() as conn:
        with pytest.raises(EvidenceError):
            log_tree.inclusion(conn, 99)
        with pytest.raises(EvidenceError):
            log_tree.consistency(conn, 0)
        with pytest.raises(EvidenceError):
            log_tree.consistency(conn, 1, 99)
    with pytest.raises(EvidenceError):
        decode(["!!"])
    assert decode([base64.b64encode(bytes(32)).decode()]) == [bytes(32)]


def test_a_receipt_reads_what_its_batch_lacks_from_the_log(audit_store: AuditStore, log_key: LogKey) -> None:
    """The binding and completions of a request finished in a later commit than its rows come from the tables."""
    from loraledger.store.records import AuditBatch, EventKind

    audit_store.log_key = log_key
    first = sample_batch(["f1"])
    audit_store.write(AuditBatch(adapters=first.adapters, requests=first.requests, completions=first.completions,
                                 events=[e for e in first.events if e.kind != EventKind.REQUEST_FINISHED]))  # fmt: skip
    got: dict = {}
    audit_store.write(AuditBatch(events=[e for e in first.events if e.kind == EventKind.REQUEST_FINISHED]), got)
    body = receipt.check_signature(got["f1"], log_key.verifier)
    assert body["tenant"] == "acme" and body["prompt_sha256"] == "c" * 64
    assert receipt.matching_completion(body, " hello") == 0
    # the same request written in one commit gets the same body but for its log position and time
    audit_store.write(sample_batch(["f2"]), got)
    other = receipt.check_signature(got["f2"], log_key.verifier)
    same = {k for k in body if body[k] == other[k]}
    assert same >= {"tenant", "adapter_fingerprint", "base_model_fingerprint", "completions", "prompt_sha256", "log"}
