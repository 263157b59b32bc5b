"""The log's Ed25519 key: it signs checkpoints and receipts under the log's origin name.

A PEM private key file (PKCS8, as `loraledger audit keygen` writes). By default the engine keeps one
in its data folder, made on first use; the origin (the name in every checkpoint and signature line)
defaults to `loraledger/` followed by 16 hex digits of the public key's SHA-256, so two logs with two
keys never share an origin. Third parties need only the verifier key (`vkey`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from loraledger import digests, paths
from loraledger.evidence import signed_note
from loraledger.evidence.signed_note import ED25519, NoteSignature, Verifier

LOG_KEY_ENV = "LORALEDGER_LOG_KEY"  # a PEM file; unset: the default key in the data folder
LOG_ORIGIN_ENV = "LORALEDGER_LOG_ORIGIN"


def default_key_path() -> Path:
    return paths.data_dir() / "log_key.pem"


def default_origin(key: Ed25519PrivateKey) -> str:
    return "loraledger/" + digests.bytes_sha256(signed_note.raw_public(key.public_key()))[:16]


class LogKey:
    """The log's signing key and its origin name."""

    def __init__(self, key: Ed25519PrivateKey, origin: str | None = None):
        self._key = key
        self.origin = signed_note.check_name(origin or default_origin(key))
        self.verifier = Verifier(self.origin, ED25519, signed_note.raw_public(key.public_key()))

    @classmethod
    def load(cls, path: Path | str | None = None, origin: str | None = None, *, create: bool = False) -> LogKey:
        """The key at path (else $LORALEDGER_LOG_KEY, else the default file, made when create is set)."""
        # imported here: the audit package imports the store, which imports this module
        from loraledger.audit.signing import generate_ed25519_key, load_private_key

        chosen = Path(path or os.environ.get(LOG_KEY_ENV) or default_key_path())
        if create and path is None and not os.environ.get(LOG_KEY_ENV) and not chosen.exists():
            chosen.parent.mkdir(parents=True, exist_ok=True)
            try:
                generate_ed25519_key(chosen)
            except Exception:
                if not chosen.exists():
                    raise
                # another engine made it first: give it a moment to finish writing, then use theirs
                deadline = time.monotonic() + 2.0
                while chosen.stat().st_size == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
        return cls(load_private_key(chosen), origin or os.environ.get(LOG_ORIGIN_ENV))

    def sign_note(self, text: str) -> NoteSignature:
        return signed_note.sign(text, self.origin, self._key)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)
