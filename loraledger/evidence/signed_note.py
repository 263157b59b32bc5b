"""C2SP signed notes (c2sp.org/signed-note): text signed by named Ed25519 keys, key ids, verifier keys (vkeys).

A note is UTF-8 text ending in a newline, a blank line, then signature lines
`— <key name> base64(4-byte key id || signature)`. An Ed25519 key's id is
SHA-256(name || 0x0A || 0x01 || public key)[:4] and it signs the text; a witness's cosignature/v1
key uses type 0x04 instead (see cosignature.py). A vkey writes a verifier as
`<name>+<hex key id>+base64(type || public key)`.
"""

from __future__ import annotations

import base64
import binascii

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from loraledger import digests
from loraledger.errors import EvidenceError

ED25519 = 0x01
COSIGNATURE_V1 = 0x04
SIG_PREFIX = "\u2014 "  # em dash, space
MAX_NOTE_BYTES = 1 << 20  # a note is a few hundred bytes; a larger one is refused before it is parsed
MAX_SIGNATURES = 100


class NoteSignature(msgspec.Struct, frozen=True):
    name: str
    key_id: bytes  # 4 bytes
    signature: bytes  # what follows the key id: an Ed25519 signature, or a timestamped one for cosignatures


class Note(msgspec.Struct, frozen=True):
    text: str  # the signed text, final newline included
    signatures: list[NoteSignature]

    def render(self) -> str:
        lines = [f"{SIG_PREFIX}{s.name} {base64.b64encode(s.key_id + s.signature).decode()}\n" for s in self.signatures]
        return self.text + "\n" + "".join(lines)


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


key_id = digests.note_key_id


def check_name(name: str) -> str:
    if not name or any(c.isspace() or c == "+" for c in name) or not name.isprintable():
        raise EvidenceError(f"key name {name!r} must be non-empty printable text with no spaces and no '+'")
    return name


class Verifier(msgspec.Struct, frozen=True):
    """A named public key of one signature type: what a vkey encodes."""

    name: str
    key_type: int
    public: bytes

    @property
    def key_id(self) -> bytes:
        return key_id(self.name, self.key_type, self.public)

    def vkey(self) -> str:
        return f"{self.name}+{self.key_id.hex()}+{base64.b64encode(bytes([self.key_type]) + self.public).decode()}"

    def public_key(self) -> Ed25519PublicKey:
        return Ed25519PublicKey.from_public_bytes(self.public)


def parse_vkey(text: str) -> Verifier:
    """A vkey `<name>+<hex key id>+<base64 type||key>`; its key id must match what it encodes."""
    parts = text.strip().split("+", 2)  # the name holds no "+", the base64 may
    if len(parts) != 3:
        raise EvidenceError(f"{text!r} is not a vkey (<name>+<hex key id>+<base64 key>)")
    name, hex_id, b64 = parts
    try:
        raw = base64.b64decode(b64, validate=True)
        claimed = bytes.fromhex(hex_id)
    except (binascii.Error, ValueError):
        raise EvidenceError(f"vkey {text!r}: the key id or key is not hex / base64") from None
    if len(raw) != 33 or raw[0] not in (ED25519, COSIGNATURE_V1):
        raise EvidenceError(f"vkey {text!r}: only Ed25519 (0x01) and cosignature/v1 (0x04) keys are supported")
    verifier = Verifier(check_name(name), raw[0], raw[1:])
    if verifier.key_id != claimed:
        raise EvidenceError(f"vkey {text!r}: its key id does not match its name and key")
    return verifier


def sign(text: str, name: str, key: Ed25519PrivateKey) -> NoteSignature:
    """The Ed25519 (type 0x01) signature line of key on text."""
    _check_text(text)
    kid = key_id(check_name(name), ED25519, raw_public(key.public_key()))
    return NoteSignature(name, kid, key.sign(text.encode()))


def _check_text(text: str) -> None:
    if not text.endswith("\n") or "\n\n" in text:
        raise EvidenceError("a note's text must end in a newline and hold no blank line")
    if any(ord(c) < 0x20 and c != "\n" for c in text):
        raise EvidenceError("a note's text must hold no control characters but newlines")


def parse(data: str | bytes) -> Note:
    """A signed note, split into its text and signature lines (none verified here)."""
    if isinstance(data, bytes):
        if len(data) > MAX_NOTE_BYTES:
            raise EvidenceError(f"a signed note of {len(data)} bytes is over the {MAX_NOTE_BYTES} byte limit")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise EvidenceError("a signed note must be UTF-8") from None
    if len(data) > MAX_NOTE_BYTES:
        raise EvidenceError(f"a signed note over {MAX_NOTE_BYTES} bytes is refused")
    split = data.rfind("\n\n")
    if split < 0:
        raise EvidenceError("not a signed note: no blank line between the text and its signatures")
    text, lines = data[: split + 1], data[split + 2 :]
    _check_text(text)
    if not lines.endswith("\n"):
        raise EvidenceError("not a signed note: its last signature line does not end in a newline")
    signatures = []
    for line in lines[:-1].split("\n"):
        if not line.startswith(SIG_PREFIX):
            raise EvidenceError(f"not a signature line: {line[:80]!r}")
        name, _, b64 = line[len(SIG_PREFIX) :].partition(" ")
        try:
            raw = base64.b64decode(b64, validate=True)
        except binascii.Error:
            raise EvidenceError(f"signature line of {name!r}: not base64") from None
        if len(raw) < 5 or not name or " " in b64:
            raise EvidenceError(f"signature line of {name!r} is malformed")
        signatures.append(NoteSignature(name, raw[:4], raw[4:]))
    if not signatures or len(signatures) > MAX_SIGNATURES:
        raise EvidenceError(f"a signed note needs 1 to {MAX_SIGNATURES} signatures, this one has {len(signatures)}")
    return Note(text, signatures)


def signature_of(note: Note, verifier: Verifier) -> NoteSignature | None:
    """The first signature line that names verifier (by name and key id), or None."""
    return next((s for s in note.signatures if s.name == verifier.name and s.key_id == verifier.key_id), None)


def verify(note: Note, verifier: Verifier) -> bool:
    """True when note carries a valid Ed25519 (type 0x01) signature by verifier."""
    if verifier.key_type != ED25519:
        raise EvidenceError(f"{verifier.name} is not an Ed25519 note key (type {verifier.key_type:#04x})")
    found = signature_of(note, verifier)
    if found is None:
        return False
    try:
        verifier.public_key().verify(found.signature, note.text.encode())
    except InvalidSignature:
        return False
    return True
