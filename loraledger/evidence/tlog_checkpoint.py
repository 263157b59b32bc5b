"""C2SP tlog-checkpoint (c2sp.org/tlog-checkpoint): the signed statement of a tree's size and root hash.

The note text is three lines, `<origin>\\n<tree size>\\n<base64 root hash>\\n`, signed by the log's
key (an Ed25519 note key named after the origin) and possibly cosigned by witnesses.
"""

from __future__ import annotations

import base64
import binascii

import msgspec

from loraledger.errors import EvidenceError
from loraledger.evidence import signed_note
from loraledger.evidence.signed_note import Note, Verifier
from loraledger.evidence.tree_hash import HASH_SIZE


class Checkpoint(msgspec.Struct, frozen=True):
    origin: str
    size: int
    root: bytes

    def text(self) -> str:
        return f"{self.origin}\n{self.size}\n{base64.b64encode(self.root).decode()}\n"


def parse_text(text: str) -> Checkpoint:
    lines = text.split("\n")
    if len(lines) < 4 or lines[-1] != "":
        raise EvidenceError("a checkpoint's text is <origin>, <tree size>, <base64 root hash>, one per line")
    origin, size, root = lines[0], lines[1], lines[2]
    if not size.isdigit() or (size != "0" and size.startswith("0")):
        raise EvidenceError(f"checkpoint tree size {size!r} is not a decimal number without leading zeros")
    try:
        digest = base64.b64decode(root, validate=True)
    except binascii.Error:
        raise EvidenceError(f"checkpoint root hash {root!r} is not base64") from None
    if len(digest) != HASH_SIZE or not origin:
        raise EvidenceError("a checkpoint needs an origin and a 32-byte root hash")
    return Checkpoint(origin, int(size), digest)


def open_checkpoint(data: str | bytes, log: Verifier) -> tuple[Checkpoint, Note]:
    """The checkpoint a signed note holds, once the log's signature on it verifies."""
    note = signed_note.parse(data)
    if not signed_note.verify(note, log):
        raise EvidenceError(
            f"the checkpoint is not signed by the log key {log.name} ({log.key_id.hex()}): signed by another key, or altered"
        )
    checkpoint = parse_text(note.text)
    if checkpoint.origin != log.name:
        raise EvidenceError(f"the checkpoint's origin {checkpoint.origin!r} is not the log key's name {log.name!r}")
    return checkpoint, note
