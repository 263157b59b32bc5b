"""The tree hashing and proofs against RFC 9162's recursive definitions, written out here independently."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraledger.evidence import tree_hash as th

# -- RFC 9162 section 2.1, as the text states it (recursion over the whole list) ---------------------


def _sha(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def mth(d: list[bytes]) -> bytes:
    n = len(d)
    if n == 0:
        return _sha(b"")
    if n == 1:
        return _sha(b"\x00" + d[0])
    k = 1
    while k * 2 < n:
        k *= 2
    return _sha(b"\x01" + mth(d[:k]) + mth(d[k:]))


def path(m: int, d: list[bytes]) -> list[bytes]:
    n = len(d)
    if n == 1:
        return []
    k = 1
    while k * 2 < n:
        k *= 2
    if m < k:
        return path(m, d[:k]) + [mth(d[k:])]
    return path(m - k, d[k:]) + [mth(d[:k])]


def subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    n = len(d)
    if m == n:
        return [] if b else [mth(d)]
    k = 1
    while k * 2 < n:
        k *= 2
    if m <= k:
        return subproof(m, d[:k], b) + [mth(d[k:])]
    return subproof(m - k, d[k:], False) + [mth(d[:k])]


def _entries(n: int) -> list[bytes]:
    return [f"entry {i}".encode() for i in range(n)]


def _stored(entries: list[bytes]) -> dict[th.NodeKey, bytes]:
    nodes: dict[th.NodeKey, bytes] = {}
    frontier = th.Frontier()
    for e in entries:
        nodes.update(frontier.append(th.leaf_hash(e)))
    return nodes


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 100])
def test_root_matches_rfc(n: int) -> None:
    entries = _entries(n)
    assert th.root_of([th.leaf_hash(e) for e in entries]) == mth(entries)
    if n:
        assert th.range_hash(0, n, _stored(entries).__getitem__) == mth(entries)


def test_known_vector() -> None:
    # the RFC 6962 reference test vector (8 leaves, Certificate Transparency's merkle_tree_test)
    leaves = [
        bytes.fromhex(h)
        for h in ["", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f"]
    ]
    assert (
        th.root_of([th.leaf_hash(x) for x in leaves]).hex()
        == "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"
    )


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 70).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))))
def test_inclusion_proof_matches_rfc_and_verifies(case: tuple[int, int]) -> None:
    n, m = case
    entries = _entries(n)
    nodes = _stored(entries)
    proof = [th.range_hash(a, b, nodes.__getitem__) for a, b in th.inclusion_ranges(m, n)]
    assert proof == path(m, entries)
    root = mth(entries)
    assert th.verify_inclusion(th.leaf_hash(entries[m]), m, n, proof, root)
    assert not th.verify_inclusion(th.leaf_hash(b"other"), m, n, proof, root)
    if proof:
        bad = [*proof[:-1], bytes(32)]
        assert not th.verify_inclusion(th.leaf_hash(entries[m]), m, n, bad, root)
    if n > 1:
        assert not th.verify_inclusion(th.leaf_hash(entries[m]), (m + 1) % n, n, proof, root)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 70).flatmap(lambda n: st.tuples(st.integers(1, n), st.just(n))))
def test_consistency_proof_matches_rfc_and_verifies(case: tuple[int, int]) -> None:
    m, n = case
    entries = _entries(n)
    nodes = _stored(entries)
    proof = [th.range_hash(a, b, nodes.__getitem__) for a, b in th.consistency_ranges(m, n)]
    assert proof == subproof(m, entries, True)
    assert th.verify_consistency(m, mth(entries[:m]), n, mth(entries), proof)
    rewritten = [*entries[: m - 1], b"rewritten", *entries[m:]]
    assert not th.verify_consistency(m, mth(rewritten[:m]), n, mth(entries), proof)
    if m < n:
        assert not th.verify_consistency(m, mth(entries[:m]), n, mth(rewritten), proof)


def test_frontier_resumes_from_stored_nodes() -> None:
    entries = _entries(37)
    nodes = _stored(entries[:21])
    frontier = th.Frontier.resume(21, nodes.__getitem__)
    for e in entries[21:]:
        frontier.append(th.leaf_hash(e))
    assert frontier.root() == mth(entries)


def test_out_of_range_proofs_are_refused() -> None:
    with pytest.raises(ValueError):
        th.inclusion_ranges(5, 5)
    with pytest.raises(ValueError):
        th.consistency_ranges(6, 5)
    assert not th.verify_inclusion(th.leaf_hash(b"x"), 3, 3, [], bytes(32))
