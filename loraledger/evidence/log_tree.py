"""The log's tree as a third party sees it: signed checkpoints, inclusion and consistency proofs, read from the store.

Checkpoints the log signs are kept in `checkpoints` (one row per tree size signed), so a witness
that reads the database finds the latest one; the HTTP server signs one on request as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import Connection, Table, insert, select

from loraledger.errors import EvidenceError
from loraledger.evidence import node_store
from loraledger.evidence.proofs import ConsistencyProof, InclusionProof, encode
from loraledger.evidence.signed_note import Note
from loraledger.evidence.tlog_checkpoint import Checkpoint
from loraledger.store.models import SignedCheckpoint

if TYPE_CHECKING:
    from loraledger.evidence.log_key import LogKey

CHECKPOINTS: Table = SignedCheckpoint.__table__  # type: ignore[assignment]


def sign_checkpoint(conn: Connection, key: LogKey, *, record: bool = True) -> str:
    """A checkpoint of the tree as it is on conn, signed by key: the note's text. record: keep it in `checkpoints`
    (once per tree size; a size signed before keeps its first note)."""
    size = node_store.size(conn)
    if size == 0:
        raise EvidenceError("the log is empty: there is no tree to sign a checkpoint of")
    checkpoint = Checkpoint(key.origin, size, node_store.root(conn, size))
    note = Note(checkpoint.text(), [key.sign_note(checkpoint.text())]).render()
    if record:
        existing = conn.execute(select(CHECKPOINTS.c.note).where(CHECKPOINTS.c.tree_size == size)).scalar()
        if existing is not None:
            return existing
        conn.execute(
            insert(CHECKPOINTS),
            {"tree_size": size, "note": note, "log_key": key.verifier.vkey()},
        )
    return note


def latest_note(conn: Connection) -> str | None:
    """The signed checkpoint of the largest tree on record in `checkpoints`."""
    return conn.execute(select(CHECKPOINTS.c.note).order_by(CHECKPOINTS.c.tree_size.desc()).limit(1)).scalar()


def _check_size(conn: Connection, tree_size: int | None) -> int:
    size = node_store.size(conn)
    if tree_size is None:
        return size
    if not 0 < tree_size <= size:
        raise EvidenceError(f"tree size {tree_size} is not between 1 and the log's {size} leaves")
    return tree_size


def inclusion(conn: Connection, leaf_index: int, tree_size: int | None = None) -> InclusionProof:
    size = _check_size(conn, tree_size)
    if not 0 <= leaf_index < size:
        raise EvidenceError(f"leaf {leaf_index} is not in a tree of {size} leaves (leaf i is event seq i + 1)")
    return InclusionProof(
        leaf_index=leaf_index, tree_size=size, hashes=encode(node_store.inclusion_proof(conn, leaf_index, size))
    )


def consistency(conn: Connection, old_size: int, new_size: int | None = None) -> ConsistencyProof:
    size = _check_size(conn, new_size)
    if not 0 < old_size <= size:
        raise EvidenceError(f"old size {old_size} is not between 1 and the new size {size}")
    return ConsistencyProof(
        old_size=old_size, new_size=size, hashes=encode(node_store.consistency_proof(conn, old_size, size))
    )
