"""SlotTable: which adapter fingerprint each device slot holds, which adapters are pinned, and which slot to take next.

The scheduler's view of the device's adapter slots (the device tensors are the runner's). A slot is assigned
to an adapter when a step needs it and holds it until another adapter takes the slot: a free slot first,
otherwise the least recently used slot whose adapter the caller does not keep (those with running sequences)
and nobody pinned. Loads and evictions are counted per adapter name for the engine's metrics.
"""

from __future__ import annotations

from collections import Counter

from loraledger.errors import InternalError


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._fingerprint: list[str | None] = [None] * num_slots  # slot -> adapter fingerprint
        self._slot: dict[str, int] = {}  # adapter fingerprint -> slot
        self._used_step: list[int] = [-1] * num_slots  # the last step each slot served
        self._names: dict[str, str] = {}  # fingerprint -> adapter name, for the counters
        self._pinned: dict[str, object] = {}  # fingerprint -> checkpoint, kept in a slot until unpinned
        self.loads: Counter[str] = Counter()  # adapter name -> times copied into a slot
        self.evictions: Counter[str] = Counter()  # adapter name -> times another adapter took its slot

    # --- pinning ------------------------------------------------------------------------------

    def pin(self, fingerprint: str, checkpoint: object) -> None:
        """Keep this adapter's slot once it has one (its checkpoint is loaded from here when a step needs it)."""
        self._pinned[fingerprint] = checkpoint

    def unpin(self, fingerprint: str) -> None:
        self._pinned.pop(fingerprint, None)

    def is_pinned(self, fingerprint: str) -> bool:
        return fingerprint in self._pinned

    def pinned_checkpoint(self, fingerprint: str) -> object | None:
        return self._pinned.get(fingerprint)

    def fits(self, fingerprints: set[str]) -> bool:
        """Whether these adapters and every pinned one can hold a slot each at the same time."""
        return len(fingerprints | self._pinned.keys()) <= self.num_slots

    # --- assignment ---------------------------------------------------------------------------

    def slot_of(self, fingerprint: str) -> int | None:
        return self._slot.get(fingerprint)

    def touch(self, fingerprint: str, step: int) -> bool:
        """Mark a resident adapter's slot as used in `step`; False when the adapter holds no slot."""
        slot = self._slot.get(fingerprint)
        if slot is None:
            return False
        self._used_step[slot] = step
        return True

    def assign(self, fingerprint: str, name: str, step: int, keep: set[str]) -> int:
        """Give an adapter that holds no slot one for `step`: a free slot, else the least recently used one whose
        adapter is neither in `keep` nor pinned (that adapter is evicted). The caller then loads the weights."""
        if fingerprint in self._slot:
            raise InternalError(f"adapter {fingerprint[:12]} already holds slot {self._slot[fingerprint]}")
        slot = self._free_slot()
        if slot is None:
            slot = self._victim_slot(keep)
            evicted = self._fingerprint[slot]
            del self._slot[evicted]
            self.evictions[self._names.get(evicted, evicted[:12])] += 1
        self._names[fingerprint] = name
        self.loads[name] += 1
        self._fingerprint[slot] = fingerprint
        self._slot[fingerprint] = slot
        self._used_step[slot] = step
        return slot

    def evict(self, fingerprint: str) -> None:
        """Forget the adapter's slot without counting an eviction (its load failed: the slot may hold half of it)."""
        slot = self._slot.pop(fingerprint, None)
        if slot is not None:
            self._fingerprint[slot] = None

    def _free_slot(self) -> int | None:
        for slot, held in enumerate(self._fingerprint):
            if held is None:
                return slot
        return None

    def _victim_slot(self, keep: set[str]) -> int:
        candidates = [
            slot
            for slot, held in enumerate(self._fingerprint)
            if held not in keep and held not in self._pinned  # never the slot of an adapter still running
        ]
        if not candidates:
            raise InternalError(
                f"no adapter slot can be taken: all {self.num_slots} hold adapters that are running or pinned "
                "(the scheduler planned more adapters than there are slots)"
            )
        return min(candidates, key=lambda slot: self._used_step[slot])
