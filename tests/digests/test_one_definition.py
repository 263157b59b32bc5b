"""loraledger.digests is the only place an audit digest is computed: no other module of the package hashes.

The engine's own modules (the folders pyproject.toml maps into the package) are read, not imported. A module may
use hashlib or hmac only if it is digests.py or is named below with the reason its hashes are not audit digests;
BLAKE2 (which no audit digest uses) is free for in-memory keys such as the prefix cache's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("loraledger", "actors", "gpu", "store", "audit", "migrations")
DIGESTS = "loraledger/digests.py"
NOT_AUDIT_DIGESTS = {
    "loraledger/server/auth.py": "API keys are kept as their sha256, compared at the door and never on the audit record",
    "audit/signing.py": "report bundles are signed with HMAC-SHA256 under a secret key: a signature, not a digest",
}
_FREE = {"blake2b", "blake2s"}


def hashing_uses(source: str) -> list[str]:
    """What a module's source does with hashlib / hmac, beyond BLAKE2: one line per use."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in ("hashlib", "hmac"):
            names = [a.name for a in node.names if a.name not in _FREE]
            uses += [f"line {node.lineno}: from {node.module} import {n}" for n in names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("hashlib", "hmac") and node.attr not in _FREE:
                uses.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            uses.append(f"line {node.lineno}: __import__")
    return uses


def _modules() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py") if ".cache" not in p.parts)


def test_only_digests_computes_audit_digests():
    offenders = {}
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        if rel == DIGESTS or rel in NOT_AUDIT_DIGESTS:
            continue
        uses = hashing_uses(path.read_text(encoding="utf-8"))
        if uses:
            offenders[rel] = uses
    assert not offenders, (
        f"hash computed outside loraledger/digests.py (define it there, spec in DIGESTS.md): {offenders}"
    )


def test_the_exceptions_still_exist_and_still_hash():
    """An exception for a module that no longer hashes (or no longer exists) is removed, so the list stays true."""
    for rel in NOT_AUDIT_DIGESTS:
        assert hashing_uses((ROOT / rel).read_text(encoding="utf-8")), f"{rel} no longer hashes: drop its exception"
    assert hashing_uses((ROOT / DIGESTS).read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "source",
    [
        "import hashlib\nh = hashlib.sha256(b'x').hexdigest()\n",
        "from hashlib import sha256\n",
        "import hashlib\nhashlib.new('sha256')\n",
        "import hmac, hashlib\nhmac.new(b'k', b'm', 'sha256')\n",
        "import hashlib\nf = hashlib.file_digest\n",
    ],
)
def test_the_scan_finds_a_hash(source):
    assert hashing_uses(source)


@pytest.mark.parametrize(
    "source",
    ["import hashlib\nhashlib.blake2b(b'x', digest_size=32)\n", "from loraledger.digests import digest\n", "sha = 1\n"],
)
def test_the_scan_lets_other_code_be(source):
    assert hashing_uses(source) == []
