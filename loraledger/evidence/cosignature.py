"""C2SP cosignature/v1 (c2sp.org/tlog-cosignature): a witness's timestamped Ed25519 signature on a checkpoint.

Key id: SHA-256(name || 0x0A || 0x04 || public key)[:4]. Signed message: `cosignature/v1\\n`,
`time <unix seconds>\\n`, then the checkpoint's whole note text. The signature line carries the
8-byte big-endian timestamp followed by the 64-byte Ed25519 signature.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from loraledger.errors import EvidenceError
from loraledger.evidence import signed_note
from loraledger.evidence.signed_note import COSIGNATURE_V1, Note, NoteSignature, Verifier


def message(text: str, timestamp: int) -> bytes:
    return f"cosignature/v1\ntime {timestamp}\n{text}".encode()


def verifier_for(name: str, key: Ed25519PrivateKey) -> Verifier:
    return Verifier(signed_note.check_name(name), COSIGNATURE_V1, signed_note.raw_public(key.public_key()))


def cosign(text: str, name: str, key: Ed25519PrivateKey, timestamp: int) -> NoteSignature:
    if not 0 <= timestamp < 1 << 63:
        raise EvidenceError(f"cosignature timestamp {timestamp} is out of range")
    kid = verifier_for(name, key).key_id
    return NoteSignature(name, kid, struct.pack(">Q", timestamp) + key.sign(message(text, timestamp)))


def verified_time(note: Note, witness: Verifier) -> int | None:
    """The time of witness's valid cosignature on note, or None when it has none (or an invalid one)."""
    if witness.key_type != COSIGNATURE_V1:
        raise EvidenceError(f"{witness.name} is not a cosignature/v1 key (type {witness.key_type:#04x})")
    found = signed_note.signature_of(note, witness)
    if found is None or len(found.signature) != 72:
        return None
    (timestamp,) = struct.unpack(">Q", found.signature[:8])
    try:
        witness.public_key().verify(found.signature[8:], message(note.text, timestamp))
    except InvalidSignature:
        return None
    return timestamp
