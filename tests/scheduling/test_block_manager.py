"""Tests for loraledger/scheduling/block_manager.py: prefix reuse per salt, ref counts, LRU eviction, fork, and a stateful property test."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loraledger.errors import InternalError
from loraledger.scheduling.block_manager import BlockManager

BS = 4


def _run(bm: BlockManager, seq_id: int, tokens: list[int], salt: str = "") -> list[int]:
    """Admit a sequence the way the scheduler does, compute all its tokens, and index its full blocks."""
    prefix, _ = bm.lookup_prefix(tokens, salt)
    assert bm.can_allocate(seq_id, len(tokens), prefix)
    table = bm.allocate(seq_id, len(tokens), prefix)
    bm.cache_full_blocks(seq_id, tokens, len(tokens), salt)
    return table


def test_reuse_under_same_salt_refused_under_another():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))  # two full blocks + a partial one
    table = _run(bm, 1, tokens, salt="adapter-a")
    bm.free(1)
    assert bm.lookup_prefix(tokens, "adapter-a") == (table[:2], 8)
    assert bm.lookup_prefix(tokens, "adapter-b") == ([], 0)
    assert bm.lookup_prefix([99] + tokens[1:], "adapter-a") == ([], 0)  # the chain covers the first block too
    assert bm.stats.queries == 4 and bm.stats.hit_tokens == 8  # _run's own lookup counts as well


def test_base_model_and_adapter_never_share():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(9))
    _run(bm, 1, tokens, salt="")
    assert bm.lookup_prefix(tokens, "fingerprint-of-an-adapter") == ([], 0)
    _run(bm, 2, tokens, salt="fingerprint-of-an-adapter")
    assert set(bm.block_table(1)).isdisjoint(bm.block_table(2))
    assert bm.lookup_prefix(tokens, "")[0] == bm.block_table(1)[:2]
    assert bm.lookup_prefix(tokens, "fingerprint-of-an-adapter")[0] == bm.block_table(2)[:2]


def test_lookup_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))  # exactly two full blocks, both cached
    table = _run(bm, 1, tokens)
    assert bm.lookup_prefix(tokens, "") == (table[:1], 4)
    assert bm.lookup_prefix(tokens + [8], "") == (table[:2], 8)
    assert bm.lookup_prefix([], "") == ([], 0)


def test_two_sequences_share_a_prefix_with_ref_counts():
    bm = BlockManager(num_blocks=6, block_size=BS)
    first = _run(bm, 1, list(range(9)))  # 3 blocks, 2 of them hashed while still running
    assert bm.num_free_blocks == 3
    second = _run(bm, 2, list(range(8)) + [50, 51])
    assert second[:2] == first[:2] and second[2] != first[2]
    assert bm.num_free_blocks == 2  # the shared blocks were not taken twice
    bm.free(1)
    assert bm.num_free_blocks == 3  # only seq 1's private tail came back; the shared blocks are still held by seq 2
    bm.free(2)
    assert bm.num_free_blocks == 6
    assert bm.lookup_prefix(list(range(9)), "")[1] == 8  # still cached, now evictable


def test_eviction_is_least_recently_released_first_and_drops_the_hash():
    bm = BlockManager(num_blocks=3, block_size=BS)
    old, new = [1, 1, 1, 1, 0], [2, 2, 2, 2, 0]
    old_block = _run(bm, 1, old)[0]
    bm.free(1)  # released first: the LRU victim
    new_block = _run(bm, 2, new)[0]
    bm.free(2)
    assert bm.num_free_blocks == 3
    table = bm.allocate(3, 2 * BS)  # one free block, then one eviction
    assert old_block in table and new_block not in table
    assert bm.lookup_prefix(old, "") == ([], 0)
    assert bm.lookup_prefix(new, "") == ([new_block], 4)
    # adopting removes the cached block from the LRU, so it is not evicted from under its user
    bm.free(3)
    prefix, _ = bm.lookup_prefix(new, "")
    assert bm.allocate(4, 5, prefix)[0] == new_block
    assert new_block not in bm.allocate(5, 4)


def test_partial_blocks_are_never_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(12))
    bm.allocate(1, len(tokens))
    bm.cache_full_blocks(1, tokens, 6, "")  # KV for 1.5 blocks
    assert bm.lookup_prefix(tokens, "") == (bm.block_table(1)[:1], 4)
    bm.cache_full_blocks(1, tokens[:7], 7, "")
    assert bm.lookup_prefix(tokens, "")[1] == 4
    bm.free(1)
    assert bm.num_free_blocks == 8
    assert bm.lookup_prefix(tokens, "")[1] == 4


def test_can_allocate_false_when_exhausted_true_after_free():
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.allocate(1, 3 * BS)
    assert bm.can_allocate(2, BS) and not bm.can_allocate(2, BS + 1)
    with pytest.raises(InternalError, match="can_allocate"):
        bm.allocate(2, BS + 1)
    with pytest.raises(InternalError, match="holds no blocks"):
        bm.block_table(2)  # the refused allocate left nothing behind
    assert bm.can_allocate(1, 4 * BS) and not bm.can_allocate(1, 4 * BS + 1)
    bm.free(1)
    assert bm.can_allocate(2, 4 * BS)
    assert len(bm.allocate(2, 4 * BS)) == 4


def test_can_allocate_counts_adopted_evictable_blocks():
    bm = BlockManager(num_blocks=3, block_size=BS)
    tokens = list(range(9))
    _run(bm, 1, tokens)
    bm.free(1)
    prefix, _ = bm.lookup_prefix(tokens, "")
    assert len(prefix) == 2 and bm.num_free_blocks == 3
    assert bm.can_allocate(2, 3 * BS, prefix)  # 2 adopted + 1 fresh
    assert not bm.can_allocate(2, 3 * BS + 1, prefix)  # the adopted blocks cannot also be evicted for it


def test_stale_prefix_blocks_are_refused():
    bm = BlockManager(num_blocks=2, block_size=BS)
    tokens = list(range(5))
    _run(bm, 1, tokens)
    bm.free(1)
    prefix, _ = bm.lookup_prefix(tokens, "")
    bm.allocate(2, 2 * BS)  # evicts the cached block the lookup returned
    bm.free(2)
    with pytest.raises(InternalError, match="no longer cached"):
        bm.allocate(3, 5, prefix)
    assert bm.num_free_blocks == 2  # the refused allocate changed nothing
    with pytest.raises(InternalError, match="holds no blocks"):
        bm.block_table(3)


def test_fork_shares_only_full_computed_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))
    parent = _run(bm, 1, tokens)
    assert bm.num_free_blocks == 5
    child = bm.fork(1, 2)
    assert child == parent[:2] and bm.num_free_blocks == 5
    grown = bm.allocate(2, 11)
    assert grown[:2] == parent[:2] and grown[2] not in parent
    bm.free(1)
    assert bm.num_free_blocks == 5 - 1 + 1  # parent's private tail returns, the shared blocks stay held
    with pytest.raises(InternalError):
        bm.fork(1, 3)
    bm.free(2)
    assert bm.num_free_blocks == 8


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    tokens = list(range(9))
    _run(bm, 1, tokens)
    bm.free(1)
    assert bm.lookup_prefix(tokens, "") == ([], 0)
    bm.allocate(1, 9)
    bm.cache_full_blocks(1, tokens, 9, "")
    assert bm.fork(1, 2) == bm.block_table(1)[:2]  # fork still shares the full blocks
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 4


# ---- property test ---------------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 40], [1, 2, 3, 4, 50], [7] * 13, [1, 2, 3]]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, steps, forks and frees; the books must always balance, and a shared block
    must hold the same salted token prefix for every holder (the KV it contains is what each expects)."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=8, block_size=BS)
        self.seqs: dict[int, tuple[str, list[int], int]] = {}  # seq id -> (salt, tokens, computed)
        self.content: dict[int, tuple[str, tuple[int, ...]]] = {}  # block -> (salt, prefix) of the KV it holds
        self.next_id = 0

    def _record(self, seq_id: int) -> None:
        salt, tokens, computed = self.seqs[seq_id]
        for k, block in enumerate(self.bm.block_table(seq_id)[: computed // BS]):
            self.content[block] = (salt, tuple(tokens[: (k + 1) * BS]))

    @rule(prompt=st.sampled_from(PROMPTS), salt=st.sampled_from(["", "a", "b"]))
    def admit(self, prompt, salt):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        prefix, cached = self.bm.lookup_prefix(prompt, salt)
        assert cached < len(prompt)
        for k, block in enumerate(prefix):
            assert self.content[block] == (salt, tuple(prompt[: (k + 1) * BS]))
        if self.bm.can_allocate(seq_id, len(prompt), prefix):
            self.bm.allocate(seq_id, len(prompt), prefix)
            self.seqs[seq_id] = (salt, list(prompt), cached)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 6), new_token=st.integers(0, 3))
    def step(self, data, chunk, new_token):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        salt, tokens, computed = self.seqs[seq_id]
        if computed == len(tokens):
            tokens = tokens + [new_token]  # decode: the sampled token is appended, its KV comes next
        target = min(len(tokens), computed + chunk)
        if not self.bm.can_allocate(seq_id, target):
            return
        self.bm.allocate(seq_id, target)
        self.bm.cache_full_blocks(seq_id, tokens, target, salt)
        self.seqs[seq_id] = (salt, tokens, target)
        self._record(seq_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        salt, tokens, computed = self.seqs[parent]
        child, self.next_id = self.next_id, self.next_id + 1
        table = self.bm.fork(parent, child)
        assert len(table) == computed // BS
        self.seqs[child] = (salt, list(tokens), len(table) * BS)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(seq_id)
        del self.seqs[seq_id]

    @invariant()
    def books_balance(self):
        holders: dict[int, list[tuple[int, int]]] = {}
        for seq_id in self.seqs:
            for k, block in enumerate(self.bm.block_table(seq_id)):
                assert 0 <= block < self.bm.num_blocks
                holders.setdefault(block, []).append((seq_id, k))
        assert len(holders) + self.bm.num_free_blocks == self.bm.num_blocks
        for block, held_by in holders.items():
            if len(held_by) == 1:
                continue
            for seq_id, k in held_by:
                salt, tokens, computed = self.seqs[seq_id]
                assert k < computed // BS, f"block {block} shared but not full and computed in seq {seq_id}"
                assert self.content[block] == (salt, tuple(tokens[: (k + 1) * BS]))


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None, database=None)
test_block_manager_property = BlockManagerMachine.TestCase
