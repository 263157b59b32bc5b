"""Inclusion and consistency proofs as they travel (JSON, hashes in base64), and their checks against checkpoints."""

from __future__ import annotations

import base64
import binascii

import msgspec

from loraledger.errors import EvidenceError
from loraledger.evidence import tree_hash as th
from loraledger.evidence.tlog_checkpoint import Checkpoint

MAX_PROOF_HASHES = 128  # a proof in a tree of 2^63 leaves has at most 2 * 63 hashes


class InclusionProof(msgspec.Struct, frozen=True, kw_only=True):
    leaf_index: int
    tree_size: int
    hashes: list[str]  # base64, leaf side first


class ConsistencyProof(msgspec.Struct, frozen=True, kw_only=True):
    old_size: int
    new_size: int
    hashes: list[str]


def encode(hashes: list[bytes]) -> list[str]:
    return [base64.b64encode(h).decode() for h in hashes]


def decode(hashes: list[str]) -> list[bytes]:
    if len(hashes) > MAX_PROOF_HASHES:
        raise EvidenceError(f"a proof of {len(hashes)} hashes is longer than any tree allows ({MAX_PROOF_HASHES})")
    try:
        out = [base64.b64decode(h, validate=True) for h in hashes]
    except (binascii.Error, TypeError):
        raise EvidenceError("a proof hash is not base64") from None
    if any(len(h) != th.HASH_SIZE for h in out):
        raise EvidenceError("a proof hash is not 32 bytes")
    return out


def check_inclusion(leaf: bytes, proof: InclusionProof, checkpoint: Checkpoint) -> None:
    """Raise EvidenceError unless proof shows leaf (a leaf hash) in the checkpoint's tree."""
    if proof.tree_size != checkpoint.size:
        raise EvidenceError(
            f"the proof is for a tree of {proof.tree_size} leaves, the checkpoint's has {checkpoint.size}"
        )
    if not th.verify_inclusion(leaf, proof.leaf_index, proof.tree_size, decode(proof.hashes), checkpoint.root):
        raise EvidenceError(
            f"leaf {proof.leaf_index} is not in the checkpoint's tree of {checkpoint.size}: the proof does not lead "
            "to its root hash (the entry or the log was altered)"
        )


def check_consistency(old: Checkpoint, new: Checkpoint, proof: ConsistencyProof) -> None:
    """Raise EvidenceError unless proof shows new's tree extends old's (the log only grew)."""
    if (proof.old_size, proof.new_size) != (old.size, new.size):
        raise EvidenceError(
            f"the proof is from {proof.old_size} to {proof.new_size} leaves, the checkpoints are {old.size} and {new.size}"
        )
    if not th.verify_consistency(old.size, old.root, new.size, new.root, decode(proof.hashes)):
        raise EvidenceError(
            f"the tree of {new.size} leaves does not extend the one of {old.size}: the log was rewritten"
        )
