"""Signed notes, checkpoints and cosignatures: round trips, the C2SP key id rules, and every tampering refused."""

from __future__ import annotations

import base64
import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from loraledger.errors import EvidenceError
from loraledger.evidence import cosignature, signed_note
from loraledger.evidence.log_key import LogKey
from loraledger.evidence.signed_note import Note
from loraledger.evidence.tlog_checkpoint import Checkpoint, open_checkpoint, parse_text
from loraledger.evidence.witness import check_cosigned


def _signed(key: LogKey, size: int = 5, root: bytes = b"\x01" * 32) -> str:
    text = Checkpoint(key.origin, size, root).text()
    return Note(text, [key.sign_note(text)]).render()


def test_checkpoint_note_round_trip_and_key_id() -> None:
    key = LogKey(Ed25519PrivateKey.generate(), "example.com/log")
    note = _signed(key)
    lines = note.split("\n")
    assert lines[:3] == ["example.com/log", "5", base64.b64encode(b"\x01" * 32).decode()]
    assert lines[3] == "" and lines[4].startswith("\u2014 example.com/log ")
    # key id: SHA-256(name || 0x0A || 0x01 || public key)[:4], and the vkey encodes it
    expected = hashlib.sha256(b"example.com/log\n\x01" + key.verifier.public).digest()[:4]
    assert base64.b64decode(lines[4].split(" ")[2])[:4] == expected
    assert signed_note.parse_vkey(key.verifier.vkey()) == key.verifier
    checkpoint, _ = open_checkpoint(note, key.verifier)
    assert checkpoint == Checkpoint("example.com/log", 5, b"\x01" * 32)


@pytest.mark.parametrize(
    "edit",
    [
        lambda n: n.replace("\n5\n", "\n6\n", 1),
        lambda n: n.replace("example.com/log\n", "example.com/lag\n", 1),
        lambda n: n[:-10] + ("A" if n[-10] != "A" else "B") + n[-9:],
    ],
)
def test_an_altered_checkpoint_is_refused(edit) -> None:
    key = LogKey(Ed25519PrivateKey.generate(), "example.com/log")
    with pytest.raises(EvidenceError):
        open_checkpoint(edit(_signed(key)), key.verifier)


def test_another_keys_checkpoint_is_refused() -> None:
    key, other = (LogKey(Ed25519PrivateKey.generate(), "example.com/log") for _ in range(2))
    with pytest.raises(EvidenceError, match="not signed by the log key"):
        open_checkpoint(_signed(other), key.verifier)


@pytest.mark.parametrize(
    "bad",
    ["", "no blank line\n", "a\n\n— name AAAA\n", "a\n1\nAAAA\n\n- x AAAAAAAA\n", "x\n\n\u2014 n " + "A" * 10],
)
def test_malformed_notes_are_typed_errors(bad: str) -> None:
    with pytest.raises(EvidenceError):
        signed_note.parse(bad)


@pytest.mark.parametrize("text", ["o\n01\nAAAA\n", "o\nx\nAAAA\n", "o\n1\nnot base64!\n", "o\n1\n"])
def test_malformed_checkpoint_text_is_refused(text: str) -> None:
    with pytest.raises(EvidenceError):
        parse_text(text)


def test_cosignature_v1_message_and_check() -> None:
    key = LogKey(Ed25519PrivateKey.generate(), "example.com/log")
    wkey = Ed25519PrivateKey.generate()
    note = signed_note.parse(_signed(key))
    sig = cosignature.cosign(note.text, "witness.example/w1", wkey, 1679315147)
    w = cosignature.verifier_for("witness.example/w1", wkey)
    assert sig.key_id == hashlib.sha256(b"witness.example/w1\n\x04" + w.public).digest()[:4]
    assert sig.signature[:8] == (1679315147).to_bytes(8, "big")
    wkey.public_key().verify(sig.signature[8:], b"cosignature/v1\ntime 1679315147\n" + note.text.encode())
    cosigned = Note(note.text, [*note.signatures, sig]).render()
    assert check_cosigned(cosigned, key.verifier, [w]).size == 5
    other = cosignature.verifier_for("witness.example/w2", Ed25519PrivateKey.generate())
    with pytest.raises(EvidenceError, match="w2"):
        check_cosigned(cosigned, key.verifier, [w, other])
    assert check_cosigned(cosigned, key.verifier, [w, other], quorum=1).size == 5
    # a cosignature on another checkpoint does not carry over
    moved = Note(_signed(key, 6).split("\n\n")[0] + "\n", [sig]).render()
    assert cosignature.verified_time(signed_note.parse(moved), w) is None


def test_vkey_with_a_wrong_key_id_is_refused() -> None:
    key = LogKey(Ed25519PrivateKey.generate(), "example.com/log")
    name, kid, b64 = key.verifier.vkey().split("+", 2)  # the base64 may hold "+"
    with pytest.raises(EvidenceError, match="key id"):
        signed_note.parse_vkey(f"{name}+00000000+{b64}")
