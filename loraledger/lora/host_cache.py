"""HostCache: the adapters held in host memory, least recently used first out, pinned ones kept."""

from __future__ import annotations

from collections import OrderedDict

from loraledger.errors import ConfigError, TooManyLoRAsError
from loraledger.lora.checkpoint import LoraCheckpoint


class HostCache:
    """At most `capacity` checkpoints by lora_int_id (max_cpu_loras), evicted least recently used first.

    A pinned id is never evicted, so pinned adapters may hold the cache above capacity; at most
    `max_pinned` ids (max_loras: each pinned adapter also keeps a device slot) may be pinned. An id
    may be pinned before its checkpoint is in the cache (a pin that is still loading).
    """

    def __init__(self, capacity: int, max_pinned: int) -> None:
        if capacity < 1 or max_pinned < 0:
            raise ConfigError(
                f"the adapter host cache needs capacity >= 1 and max_pinned >= 0, got {capacity} and {max_pinned}"
            )
        self.capacity = capacity
        self.max_pinned = max_pinned
        self._entries: OrderedDict[int, LoraCheckpoint] = OrderedDict()  # most recently used last
        self._pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, int_id: object) -> bool:
        return int_id in self._entries

    def ids(self) -> list[int]:
        """The cached ids, least recently used first."""
        return list(self._entries)

    def get(self, int_id: int) -> LoraCheckpoint | None:
        """The cached checkpoint, now the most recently used; None when it is not cached."""
        ckpt = self._entries.get(int_id)
        if ckpt is not None:
            self._entries.move_to_end(int_id)
        return ckpt

    def put(self, int_id: int, ckpt: LoraCheckpoint) -> list[LoraCheckpoint]:
        """Hold `ckpt` as the most recently used; returns what was evicted to keep within capacity (LRU first)."""
        self._entries[int_id] = ckpt
        self._entries.move_to_end(int_id)
        evicted = []
        while len(self._entries) > self.capacity:
            victim = next((i for i in self._entries if i not in self._pinned), None)
            if victim is None:
                break  # everything left is pinned
            evicted.append(self._entries.pop(victim))
        return evicted

    def discard(self, int_id: int) -> LoraCheckpoint | None:
        """Drop the cached checkpoint (its pin stays); the checkpoint, or None when it was not cached."""
        return self._entries.pop(int_id, None)

    def can_pin(self, int_id: int) -> bool:
        return int_id in self._pinned or len(self._pinned) < self.max_pinned

    def pin(self, int_id: int) -> None:
        """Never evict `int_id` until it is unpinned; TooManyLoRAsError when can_pin says no."""
        if not self.can_pin(int_id):
            raise TooManyLoRAsError(
                f"cannot pin more than max_loras={self.max_pinned} adapters (each keeps a device slot); "
                "remove_lora() a pinned adapter first, or start the engine with a larger max_loras"
            )
        self._pinned.add(int_id)

    def unpin(self, int_id: int) -> None:
        self._pinned.discard(int_id)

    def is_pinned(self, int_id: int) -> bool:
        return int_id in self._pinned
