"""The evidence commands end to end: a caller's receipt checked by a third party with the log's key and a cosigned
checkpoint; a rewritten log caught by the witness and by verify against the cosigned checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraledger.audit.signing import generate_ed25519_key
from loraledger.cli import main
from loraledger.evidence.log_key import LogKey
from loraledger.store.audit_store import AuditStore
from tests.audit.synth import build_log
from tests.db_fixtures import sample_batch
from tests.evidence.rewrite import rewrite_tail


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    generate_ed25519_key(tmp_path / "log.pem")
    generate_ed25519_key(tmp_path / "witness.pem")
    return {"log": tmp_path / "log.pem", "witness": tmp_path / "witness.pem"}


def test_a_receipt_travels_to_a_third_party(migrated_db_url: str, keys, tmp_path: Path, capsys) -> None:
    url = migrated_db_url
    with AuditStore(url) as store:
        store.log_key = LogKey.load(keys["log"])
        synth = build_log(store, n_requests=12, days=1, seed=3)
    served = next(r for r in synth.requests if r.outcome in ("stop", "length") and r.completions)
    rid, served_text = served.binding.request_id, served.completions[-1].text
    code, log_vkey = run(capsys, "audit", "vkey", "--key", str(keys["log"]))
    log_vkey = log_vkey.strip()
    code, witness_vkey = run(capsys, "audit", "vkey", "--key", str(keys["witness"]), "--witness", "w.example/1")
    witness_vkey = witness_vkey.strip()

    # the caller keeps its receipt; the log signs a checkpoint; a witness cosigns it
    code, text = run(capsys, "audit", "receipt", rid, "--url", url)
    assert code == 0 and json.loads(text)["format"] == "loraledger-receipt/v1"
    (tmp_path / "receipt.json").write_text(text)
    assert run(capsys, "audit", "sign-checkpoint", "--url", url, "--key", str(keys["log"]))[0] == 0
    witness = ["audit", "witness", "--log", url, "--log-key", log_vkey, "--key", str(keys["witness"]),
               "--name", "w.example/1", "--state", str(tmp_path / "w.json"), "--out", str(tmp_path / "cosigned")]  # fmt: skip
    code, out = run(capsys, *witness)
    assert code == 0, out
    leaf = json.loads(json.loads(text)["body"])["leaf_index"]
    code, proof = run(capsys, "audit", "prove", "--leaf", str(leaf), "--url", url)
    (tmp_path / "proof.json").write_text(proof)
    (tmp_path / "out.txt").write_text(served_text)
    (tmp_path / "wrong.txt").write_text(" goodbye")

    # the third party: no database, only the receipt, the text, the log's key, the cosigned checkpoint and the proof
    check = ["audit", "verify-receipt", str(tmp_path / "receipt.json"), "--log-key", log_vkey,
             "--checkpoint", str(tmp_path / "cosigned"), "--witness", witness_vkey, "--proof", str(tmp_path / "proof.json")]  # fmt: skip
    code, out = run(capsys, *check, "--text", str(tmp_path / "out.txt"))
    assert code == 0, out
    assert "signature OK" in out and "text OK" in out and "inclusion OK" in out and "cosigned by 1" in out
    code, out = run(capsys, *check, "--text", str(tmp_path / "wrong.txt"))
    assert code == 1 and "none of the receipt's completions" in out
    # fetched from the log instead of files
    code, out = run(capsys, "audit", "verify-receipt", str(tmp_path / "receipt.json"), "--log", url)
    assert code == 0 and "inclusion OK" in out, out

    # an edited receipt is refused with a typed error (exit 2, one line), not a traceback
    forged = json.loads(text)
    forged["body"] = forged["body"].replace(rid, rid[:-1] + ("0" if rid[-1] != "0" else "1"))
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    code, out = run(capsys, "audit", "verify-receipt", str(tmp_path / "forged.json"))
    assert code != 0 and "signature does not verify" in out and "Traceback" not in out

    # verify against the cosigned checkpoint passes while the log only grows ...
    with AuditStore(url) as store:
        store.log_key = LogKey.load(keys["log"])
        build_log(store, n_requests=4, days=1, seed=4)
    verify = ["audit", "verify", "--url", url, "--checkpoint", str(tmp_path / "cosigned"), "--log-key", log_vkey,
              "--witness", witness_vkey]  # fmt: skip
    code, out = run(capsys, *verify)
    assert code == 0 and "extends its" in out, out

    # ... and fails once the owner rewrites the tail (guards dropped, every hash and node recomputed)
    rewrite_tail(url, 12, sample_batch([f"forged-{i}" for i in range(40)], None))  # longer than before
    assert run(capsys, "audit", "sign-checkpoint", "--url", url, "--key", str(keys["log"]))[0] == 0
    code, out = run(capsys, *verify)
    assert code == 1 and "rewritten" in out, out
    code, out = run(capsys, *witness)
    assert code != 0 and "rewritten" in out, out


def test_retention_reports_what_is_past_the_minimum_per_tenant(migrated_db_url: str, capsys) -> None:
    import time

    from loraledger.store.records import AuditBatch
    from tests.db_fixtures import make_completion, make_request

    now = time.time()
    old, recent = now - 200 * 86400, now - 10 * 86400
    with AuditStore(migrated_db_url) as store:
        store.write(AuditBatch(requests=[make_request("old-1", None, tenant="acme", at=old),
                                         make_request("old-2", None, tenant="globex", at=old - 5)],
                               completions=[make_completion("old-1", None, at=old), make_completion("old-1", None, 1, at=old)]))  # fmt: skip
        store.write(AuditBatch(requests=[make_request("new-1", None, tenant="acme", at=recent)]))
    code, out = run(capsys, "audit", "retention", "--url", migrated_db_url, "--format", "json")
    report = json.loads(out)
    assert code == 0 and report["total"] == 2 and report["keep_days"] == 183
    by_tenant = {t["tenant"]: t for t in report["past"]}
    assert by_tenant["acme"]["requests"] == 1 and by_tenant["acme"]["completions"] == 2
    assert by_tenant["globex"]["completions"] == 0 and by_tenant["globex"]["prompts_with_text"] == 1
    code, out = run(capsys, "audit", "retention", "--url", migrated_db_url, "--keep-days", "5")
    assert code == 0 and "3 request(s)" in out
    code, out = run(capsys, "audit", "retention", "--url", migrated_db_url, "--keep-days", "-1")
    assert code != 0 and "keep_days" in out
