"""A witness (in the sense of C2SP tlog-witness): cosigns a log's checkpoint only when the log only grew.

It keeps, in its own state file, the last checkpoint it cosigned for each origin. Given a new
checkpoint signed by the log's key, it asks the log for a consistency proof from that size and
cosigns (cosignature/v1) only if the proof holds: a log that rewrote any entry, or shrank, is
refused, and anyone holding an earlier cosigned checkpoint can prove the rewrite.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from loraledger.errors import EvidenceError
from loraledger.evidence import cosignature
from loraledger.evidence.proofs import ConsistencyProof, check_consistency
from loraledger.evidence.signed_note import Note, Verifier
from loraledger.evidence.tlog_checkpoint import Checkpoint, open_checkpoint

ConsistencySource = Callable[[int, int], ConsistencyProof]  # (old size, new size) -> the log's proof


class Witness:
    def __init__(self, name: str, key: Ed25519PrivateKey, state_path: Path | str):
        self.name = name
        self._key = key
        self.verifier = cosignature.verifier_for(name, key)
        self.state_path = Path(state_path)

    def _state(self) -> dict[str, dict]:
        try:
            return json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as exc:
            raise EvidenceError(f"the witness state {self.state_path} cannot be read: {exc}") from None

    def last(self, origin: str) -> Checkpoint | None:
        seen = self._state().get(origin)
        return None if seen is None else Checkpoint(origin, seen["size"], base64.b64decode(seen["root"]))

    def cosign(
        self, note_text: str | bytes, log: Verifier, consistency: ConsistencySource, *, now: int | None = None
    ) -> str:
        """The checkpoint note with this witness's cosignature added; EvidenceError if the log did not only grow."""
        checkpoint, note = open_checkpoint(note_text, log)
        last = self.last(checkpoint.origin)
        if last is not None:
            if checkpoint.size < last.size:
                raise EvidenceError(
                    f"the log {checkpoint.origin} shrank: it showed {last.size} leaves before and now {checkpoint.size}"
                )
            if checkpoint.size == last.size:
                if checkpoint.root != last.root:
                    raise EvidenceError(
                        f"the log {checkpoint.origin} shows two different trees of {last.size} leaves: it was rewritten"
                    )
            else:
                check_consistency(last, checkpoint, consistency(last.size, checkpoint.size))
        stamp = int(time.time()) if now is None else now
        mine = cosignature.cosign(note.text, self.name, self._key, stamp)
        others = [s for s in note.signatures if (s.name, s.key_id) != (mine.name, mine.key_id)]
        cosigned = Note(note.text, [*others, mine]).render()
        self._save(checkpoint, cosigned)
        return cosigned

    def _save(self, checkpoint: Checkpoint, note: str) -> None:
        state = self._state()
        state[checkpoint.origin] = {
            "size": checkpoint.size,
            "root": base64.b64encode(checkpoint.root).decode(),
            "note": note,
        }
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.state_path)  # atomic: a crash leaves the old state or the new, never half


def check_cosigned(
    note_text: str | bytes, log: Verifier, witnesses: list[Verifier], *, quorum: int | None = None
) -> Checkpoint:
    """The checkpoint, once the log's signature and at least quorum (default: all) of the witnesses' cosignatures verify."""
    checkpoint, note = open_checkpoint(note_text, log)
    good = [w.name for w in witnesses if cosignature.verified_time(note, w) is not None]
    needed = len(witnesses) if quorum is None else quorum
    if len(good) < needed:
        missing = sorted({w.name for w in witnesses} - set(good))
        raise EvidenceError(
            f"the checkpoint has {len(good)} valid cosignature(s) of the {needed} required; missing or invalid: {', '.join(missing)}"
        )
    return checkpoint
