"""BlockManager: paged KV-cache block allocation with salted prefix caching (nano-vllm / vLLM v1 style).

Every block is in exactly one of three states: referenced by one or more sequences, free
(holds nothing reusable), or evictable (ref count 0 but still indexed by its hash, so a later
sequence with the same prefix can adopt it). Only FULL blocks whose KV has been computed
are hashed; a partially filled block is never shared.

A block's hash chains (parent block's hash, cache salt, the block's token ids) through
BLAKE2b-256. The salt is the adapter's fingerprint ("" for the base model), with the request's
cache_salt when it has one (SchedRequest.prefix_salt), and enters every block's hash, so KV
computed under one adapter (or salt) is never reused under another or by the base model. Collisions of a 256-bit digest are not a practical correctness risk, unlike Python's hash().

The Scheduler asks before it mutates: ``lookup_prefix`` -> ``can_allocate`` -> ``allocate``,
with no other allocation in between (an allocation may evict the blocks a lookup returned).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from loraledger.errors import InternalError

_ROOT_HASH = bytes(32)  # the parent of a sequence's first block


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters; every lookup counts (as in vLLM), so a retried admission counts again."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class _SeqState:
    table: list[int]
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of table[:len(hashes)], all full and computed
    num_computed_tokens: int = 0


def block_hash(parent: bytes, salt: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full block; ``salt`` is the UTF-8 cache salt."""
    h = hashlib.blake2b(parent, digest_size=32)
    h.update(struct.pack("<I", len(salt)))  # length-prefixed: the salt cannot bleed into the token bytes
    h.update(salt)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks  # set only on the block the index points to
        self._index: dict[bytes, int] = {}  # block hash -> block id
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref-0 hashed blocks, least recently released first
        self._seqs: dict[int, _SeqState] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def lookup_prefix(self, token_ids: Sequence[int], cache_salt: str) -> tuple[list[int], int]:
        """The longest run of cached full blocks matching the prefix under this salt, and the tokens they hold.

        At least one token is always left to compute (the model must produce logits for the
        last one), so at most ``len(token_ids) - 1`` tokens are reported cached. Takes no references.
        """
        self.stats.queries += 1
        self.stats.query_tokens += len(token_ids)
        if not self.enable_prefix_caching:
            return [], 0
        bs, salt = self.block_size, cache_salt.encode("utf-8")
        blocks: list[int] = []
        parent = _ROOT_HASH
        for k in range(max(0, len(token_ids) - 1) // bs):
            parent = block_hash(parent, salt, token_ids[k * bs : (k + 1) * bs])
            block = self._index.get(parent)
            if block is None:
                break
            blocks.append(block)
        self.stats.hit_tokens += len(blocks) * bs
        return blocks, len(blocks) * bs

    def can_allocate(self, seq_id: int, num_tokens: int, prefix_blocks: Sequence[int] = ()) -> bool:
        """Whether seq_id's table can grow to cover num_tokens tokens, after adopting prefix_blocks on a first call."""
        needed = self._blocks_needed(seq_id, num_tokens, prefix_blocks)
        # adopting an evictable block takes it out of the pool an allocation draws from
        adopted_from_pool = sum(1 for b in prefix_blocks if self._ref[b] == 0)
        return needed <= self.num_free_blocks - adopted_from_pool

    def allocate(self, seq_id: int, num_tokens: int, prefix_blocks: Sequence[int] = ()) -> list[int]:
        """Grow seq_id's table to cover num_tokens tokens (adopting prefix_blocks on the first call); the full table."""
        if not self.can_allocate(seq_id, num_tokens, prefix_blocks):
            raise InternalError(f"allocate(seq {seq_id}, {num_tokens} tokens) without room: call can_allocate first")
        if any(self._hash[b] is None for b in prefix_blocks):  # checked before anything changes
            raise InternalError(
                f"a prefix block of seq {seq_id} is no longer cached: lookup_prefix's result was used "
                "after another allocation evicted it"
            )
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _SeqState(table=[], num_computed_tokens=len(prefix_blocks) * self.block_size)
            for block in prefix_blocks:
                self._take(block)
                state.table.append(block)
                state.hashes.append(self._hash[block])
        for _ in range(self._blocks_needed(seq_id, num_tokens)):
            block = self._pop_free()
            self._ref[block] = 1
            state.table.append(block)
        return list(state.table)

    def cache_full_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int, cache_salt: str
    ) -> None:
        """Record that KV now exists for num_computed_tokens of token_ids, and index the blocks that became full.

        Call after every step that computed KV for seq_id (also with prefix caching off: fork
        relies on the computed count).
        """
        state = self._require(seq_id)
        state.num_computed_tokens = max(state.num_computed_tokens, num_computed_tokens)
        if not self.enable_prefix_caching:
            return
        bs, salt = self.block_size, cache_salt.encode("utf-8")
        num_full = min(num_computed_tokens, len(token_ids)) // bs
        for k in range(len(state.hashes), min(num_full, len(state.table))):
            parent = state.hashes[-1] if state.hashes else _ROOT_HASH
            h = block_hash(parent, salt, token_ids[k * bs : (k + 1) * bs])
            state.hashes.append(h)
            block = state.table[k]
            # another sequence may already have indexed the same content: keep that one, ours stays private
            if h not in self._index and self._hash[block] is None:
                self._index[h] = block
                self._hash[block] = h

    def free(self, seq_id: int) -> None:
        """Release seq_id's references; a no-op for a sequence that holds no blocks."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return
        # tail first: the LRU then evicts a chain's later blocks before the prefix others can still reuse
        for block in reversed(state.table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._require(seq_id).table)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> list[int]:
        """Give child_seq_id the parent's full, computed blocks (shared, ref++); the child's table.

        The tokens of the parent's partial last block are not shared: the child recomputes them
        into blocks of its own, since the parent keeps writing into that block.
        """
        parent = self._require(parent_seq_id)
        if child_seq_id in self._seqs:
            raise InternalError(f"fork: child sequence {child_seq_id} already holds blocks")
        num_full = min(parent.num_computed_tokens // self.block_size, len(parent.table))
        shared = parent.table[:num_full]
        for block in shared:
            self._ref[block] += 1
        self._seqs[child_seq_id] = _SeqState(
            table=list(shared),
            hashes=parent.hashes[:num_full],
            num_computed_tokens=num_full * self.block_size,
        )
        return list(shared)

    # ---- internals ---------------------------------------------------------------------------

    def _require(self, seq_id: int) -> _SeqState:
        state = self._seqs.get(seq_id)
        if state is None:
            raise InternalError(f"sequence {seq_id} holds no blocks (never allocated, or already freed)")
        return state

    def _blocks_needed(self, seq_id: int, num_tokens: int, prefix_blocks: Sequence[int] = ()) -> int:
        state = self._seqs.get(seq_id)
        if state is not None and prefix_blocks:
            raise InternalError(
                f"sequence {seq_id} already has a block table: prefix blocks are adopted on the first allocate only"
            )
        have = len(state.table) if state is not None else len(prefix_blocks)
        return max(0, -(-num_tokens // self.block_size) - have)

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _pop_free(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        h = self._hash[block]
        del self._index[h]
        self._hash[block] = None
        return block
