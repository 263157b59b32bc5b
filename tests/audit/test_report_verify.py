"""verify-report: an intact bundle passes; any edited byte of any file, or of the manifest, fails it."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from loraledger.audit import AuditLog
from loraledger.audit.report import MANIFEST, manifest_bytes, write_report
from loraledger.audit.report_verify import verify_report
from loraledger.digests import file_sha256
from loraledger.store.audit_store import AuditStore
from loraledger.store.migrate import upgrade
from tests.audit.conftest import REPORT_KEY
from tests.audit.synth import DAY, START, build_log

ENV = {"LORALEDGER_REPORT_KEY": REPORT_KEY}


@pytest.fixture(scope="module", params=["csv", "jsonl"])
def bundle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One signed bundle per row format (the bundle does not depend on the database dialect)."""
    root = tmp_path_factory.mktemp(f"bundle_{request.param}")
    url = f"sqlite:///{root / 'audit.sqlite3'}"
    upgrade(url)
    with AuditStore(url) as store:
        build_log(store, n_requests=40, days=3)
    with AuditLog(url) as log:
        write_report(
            log, root / "report", since=START, until=START + 3 * DAY, fmt=request.param, progress=False, env=ENV
        )
    return root / "report"


@pytest.fixture
def copy(bundle: Path, tmp_path: Path) -> Path:
    target = tmp_path / "report"
    shutil.copytree(bundle, target)
    return target


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01  # ASCII stays ASCII, and the byte always changes
    path.write_bytes(bytes(data))


def test_an_intact_bundle_verifies(copy: Path):
    check = verify_report(copy, env=ENV)
    assert check.ok, check.problems
    assert check.signature == "hmac-sha256"


def test_the_wrong_hmac_key_fails(copy: Path):
    check = verify_report(copy, env={"LORALEDGER_REPORT_KEY": "another-key-0123456789"})
    assert not check.ok and "HMAC-SHA256 signature does not match" in check.problems[0]


@pytest.mark.parametrize("name", ["requests", "completions", "report.html", MANIFEST])
def test_flipping_any_byte_fails(copy: Path, name: str):
    fmt = json.loads((copy / MANIFEST).read_bytes())["row_format"]
    path = copy / (name if "." in name else f"{name}.{fmt}")
    size = path.stat().st_size
    rng = random.Random(name)
    for offset in [0, size - 1, *rng.sample(range(1, size - 1), 6)]:
        original = path.read_bytes()
        _flip(path, offset)
        check = verify_report(copy, env=ENV)
        assert not check.ok, f"flipping byte {offset} of {path.name} went unnoticed"
        path.write_bytes(original)
    assert verify_report(copy, env=ENV).ok


@pytest.mark.parametrize("bundle", ["csv"], indirect=True)
def test_an_edited_csv_cell_fails_even_with_a_fixed_up_digest(copy: Path):
    manifest = json.loads((copy / MANIFEST).read_bytes())
    path = copy / "requests.csv"
    lines = path.read_text().split("\n")
    cells = lines[1].split(",")
    tenant = lines[0].split(",").index("tenant")
    assert cells[tenant] != "mallory"
    cells[tenant] = "mallory"
    lines[1] = ",".join(cells)
    path.write_text("\n".join(lines))
    check = verify_report(copy, env=ENV)
    assert not check.ok and any("requests.csv does not match its sha256" in p for p in check.problems)
    # an intruder without the key updates the digest too: the signature and the recount still fail
    entry = next(f for f in manifest["files"] if f["name"] == "requests.csv")
    entry["sha256"], entry["bytes"] = file_sha256(path), path.stat().st_size
    (copy / MANIFEST).write_bytes(manifest_bytes(manifest))
    check = verify_report(copy, env=ENV)
    assert not check.ok
    assert any("signature does not match" in p for p in check.problems)
    assert any("counts.by_tenant" in p for p in check.problems)


def test_an_edited_manifest_number_fails(copy: Path):
    manifest = json.loads((copy / MANIFEST).read_bytes())
    manifest["counts"]["requests"] += 1
    (copy / MANIFEST).write_bytes(manifest_bytes(manifest))
    check = verify_report(copy, env=ENV)
    assert not check.ok
    assert any("signature does not match" in p for p in check.problems)
    assert any("counts.requests" in p for p in check.problems)


def test_reformatted_manifest_and_extra_or_missing_files_fail(copy: Path):
    raw = (copy / MANIFEST).read_bytes()
    (copy / MANIFEST).write_bytes(raw.replace(b"\n", b"\r\n", 1))
    assert "was edited" in verify_report(copy, env=ENV).problems[0]
    (copy / MANIFEST).write_bytes(raw)
    (copy / "notes.txt").write_text("added later")
    check = verify_report(copy, env=ENV)
    assert not check.ok and "notes.txt is in the bundle but not listed" in check.problems[0]
    (copy / "notes.txt").unlink()
    (copy / "report.html").unlink()
    check = verify_report(copy, env=ENV)
    assert not check.ok and "report.html is missing" in check.problems[0]
    (copy / MANIFEST).unlink()
    assert "cannot read" in verify_report(copy, env=ENV).problems[0]


def test_a_shared_key_signature_does_not_pass_for_the_public_key_asked_for(copy: Path, tmp_path: Path):
    """An HMAC-signed bundle (anyone with the shared key can edit and re-sign it) fails when the verifier gives an
    Ed25519 public key: it asked for that key holder's signature."""
    from loraledger.audit.signing import generate_ed25519_key

    generate_ed25519_key(tmp_path / "key.pem", tmp_path / "pub.pem")
    check = verify_report(copy, key_file=tmp_path / "pub.pem", env=ENV)
    assert not check.ok and check.signature == "hmac-sha256"
    assert "not with the Ed25519 key given" in check.problems[0]
