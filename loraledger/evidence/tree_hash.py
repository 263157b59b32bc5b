"""RFC 9162 Merkle tree hashing: leaf and node hashes, subtree decomposition, inclusion and consistency proofs.

Pure functions over 32-byte hashes. Proof generation is split in two steps so a caller backed by a
database fetches every node a proof needs in one query: `*_ranges` names the subtrees (half-open
leaf ranges) whose hashes make up the proof, `range_nodes` names the stored complete subtrees each
range is folded from, and `range_hash` folds them. Verification follows RFC 9162 sections 2.1.3.2
and 2.1.4.2 and needs nothing but the proof.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loraledger import digests

HASH_SIZE = 32
NodeKey = tuple[int, int]  # (level, index): the complete subtree over leaves [index << level, (index + 1) << level)


leaf_hash = digests.merkle_leaf_hash  # the hashes themselves are defined with every other digest
node_hash = digests.merkle_node_hash
EMPTY_ROOT = digests.MERKLE_EMPTY_ROOT


def _split(size: int) -> int:
    """The largest power of two strictly less than size (size >= 2)."""
    return 1 << ((size - 1).bit_length() - 1)


def range_nodes(start: int, end: int) -> list[NodeKey]:
    """The complete subtrees that [start, end) is folded from, left to right. start must be aligned to the
    largest power of two not above end - start, which every range of a proof is."""
    keys: list[NodeKey] = []
    while start < end:
        size = end - start
        level = size.bit_length() - 1  # the largest power of two not above size: RFC 9162's split point
        keys.append((level, start >> level))
        start += 1 << level
    return keys


def fold(hashes: Sequence[bytes]) -> bytes:
    """MTH of a range from the hashes of its range_nodes: folded from the right, as RFC 9162 splits."""
    root = hashes[-1]
    for h in reversed(hashes[:-1]):
        root = node_hash(h, root)
    return root


def range_hash(start: int, end: int, get: Callable[[NodeKey], bytes]) -> bytes:
    """MTH(D[start:end]) from stored complete subtrees (get returns one by key)."""
    if start == end:
        return EMPTY_ROOT
    return fold([get(key) for key in range_nodes(start, end)])


def root_of(leaf_hashes: Sequence[bytes]) -> bytes:
    """MTH over leaf hashes held in memory (tests, and verify's recomputation in bounded chunks uses Frontier)."""
    frontier = Frontier()
    for h in leaf_hashes:
        frontier.append(h)
    return frontier.root()


class Frontier:
    """The right edge of a growing tree (one complete subtree per set bit of its size): O(log n) memory, so a
    verifier can recompute the root of any number of leaves read in order."""

    def __init__(self) -> None:
        self.size = 0
        self._stack: list[bytes] = []  # hashes of the complete subtrees, largest (leftmost) first

    def append(self, leaf: bytes) -> list[tuple[NodeKey, bytes]]:
        """Add one leaf hash; returns every complete subtree it completes (the leaf itself first)."""
        index, level, h = self.size, 0, leaf
        made = [((0, index), leaf)]
        while index & 1:
            h = node_hash(self._stack.pop(), h)
            index >>= 1
            level += 1
            made.append(((level, index), h))
        self._stack.append(h)
        self.size += 1
        return made

    def root(self) -> bytes:
        return fold(self._stack) if self._stack else EMPTY_ROOT

    @classmethod
    def resume(cls, size: int, get: Callable[[NodeKey], bytes]) -> Frontier:
        """The frontier of a stored tree of size leaves (get fetches its range_nodes(0, size))."""
        frontier = cls()
        frontier.size = size
        frontier._stack = [get(key) for key in range_nodes(0, size)]
        return frontier


def inclusion_ranges(index: int, size: int) -> list[tuple[int, int]]:
    """The subtrees whose hashes are the inclusion proof of leaf index in a tree of size, leaf side first
    (RFC 9162 PATH)."""
    if not 0 <= index < size:
        raise ValueError(f"leaf {index} is not in a tree of {size} leaves")
    ranges: list[tuple[int, int]] = []
    start, end = 0, size
    while end - start > 1:
        k = _split(end - start)
        if index < start + k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start += k
    return ranges[::-1]


def consistency_ranges(old: int, new: int) -> list[tuple[int, int]]:
    """The subtrees whose hashes are the consistency proof from size old to size new (RFC 9162 SUBPROOF)."""
    if not 0 < old <= new:
        raise ValueError(f"no consistency proof from a tree of {old} leaves to one of {new}")
    ranges: list[tuple[int, int]] = []
    start, end, m, whole = 0, new, old, True
    while True:
        size = end - start
        if m == size:
            if not whole:
                ranges.append((start, end))
            break
        k = _split(size)
        if m <= k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start += k
            m -= k
            whole = False
    return ranges[::-1]


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> bool:
    """RFC 9162 2.1.3.2: does proof show leaf (its leaf hash) at index in the tree of size with root?"""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root


def verify_consistency(old: int, old_root: bytes, new: int, new_root: bytes, proof: Sequence[bytes]) -> bool:
    """RFC 9162 2.1.4.2: does proof show the tree of size new with new_root extends the one of size old?"""
    if old == new:
        return not proof and old_root == new_root
    if old == 0:
        return not proof  # the empty tree is a prefix of every tree
    if old > new or not proof:
        return False
    path = list(proof)
    if old & (old - 1) == 0:
        path.insert(0, old_root)
    fn, sn = old - 1, new - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return fr == old_root and sr == new_root and sn == 0
