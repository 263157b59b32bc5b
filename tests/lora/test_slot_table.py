"""SlotTable: free slots first, then the least recently used slot of an adapter nobody keeps or pinned; counters."""

from __future__ import annotations

import pytest

from loraledger.errors import InternalError
from loraledger.lora.slot_table import SlotTable


def test_free_slots_are_taken_in_order_then_the_least_recently_used_one():
    table = SlotTable(2)
    assert table.assign("a" * 64, "a", step=0, keep=set()) == 0
    assert table.assign("b" * 64, "b", step=1, keep=set()) == 1
    assert table.touch("a" * 64, step=2)  # a was used after b: b's slot is the older one
    assert table.assign("c" * 64, "c", step=3, keep=set()) == 1
    assert table.slot_of("b" * 64) is None and table.slot_of("c" * 64) == 1
    assert dict(table.loads) == {"a": 1, "b": 1, "c": 1} and dict(table.evictions) == {"b": 1}
    assert not table.touch("b" * 64, step=4)  # b holds no slot any more


def test_a_kept_or_pinned_adapter_keeps_its_slot():
    table = SlotTable(2)
    table.assign("a" * 64, "a", step=0, keep=set())
    table.assign("b" * 64, "b", step=1, keep=set())
    # a is the least recently used, but it is running: b's slot is taken
    assert table.assign("c" * 64, "c", step=2, keep={"a" * 64}) == 1
    table.pin("a" * 64, checkpoint="ckpt-a")
    assert table.is_pinned("a" * 64) and table.pinned_checkpoint("a" * 64) == "ckpt-a"
    assert table.assign("d" * 64, "d", step=3, keep=set()) == 1  # a is older, but pinned
    with pytest.raises(InternalError, match="running or pinned"):
        table.assign("e" * 64, "e", step=4, keep={"d" * 64})
    table.unpin("a" * 64)
    assert table.pinned_checkpoint("a" * 64) is None
    assert table.assign("e" * 64, "e", step=5, keep={"d" * 64}) == 0


def test_fits_counts_pinned_adapters_and_evict_forgets_without_counting():
    table = SlotTable(2)
    table.pin("p" * 64, checkpoint=None)
    assert table.fits({"a" * 64}) and table.fits({"a" * 64, "p" * 64})
    assert not table.fits({"a" * 64, "b" * 64})
    table.assign("a" * 64, "a", step=0, keep=set())
    table.evict("a" * 64)  # its load failed: the slot may hold half of it
    assert table.slot_of("a" * 64) is None and dict(table.evictions) == {}
    assert table.assign("b" * 64, "b", step=1, keep=set()) == 0  # the slot is free again
    with pytest.raises(InternalError, match="already holds slot"):
        table.assign("b" * 64, "b", step=2, keep=set())
