"""HostCache: least recently used out first, pinned ids never evicted, at most max_pinned pins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loraledger.errors import ConfigError, TooManyLoRAsError
from loraledger.lora.host_cache import HostCache


def _ckpt(name: str):
    return SimpleNamespace(name=name)


def _filled(capacity: int, *ids: int, max_pinned: int = 2) -> tuple[HostCache, dict]:
    cache, ckpts = HostCache(capacity, max_pinned=max_pinned), {}
    for i in ids:
        ckpts[i] = _ckpt(f"a{i}")
        assert cache.put(i, ckpts[i]) == []
    return cache, ckpts


def test_put_over_capacity_evicts_the_least_recently_used():
    cache, ckpts = _filled(2, 1, 2)
    new = _ckpt("a3")
    assert cache.put(3, new) == [ckpts[1]]
    assert cache.ids() == [2, 3] and 1 not in cache and len(cache) == 2
    assert cache.get(1) is None


def test_get_makes_an_entry_the_most_recently_used():
    cache, ckpts = _filled(2, 1, 2)
    assert cache.get(1) is ckpts[1]
    assert cache.ids() == [2, 1]
    assert cache.put(3, _ckpt("a3")) == [ckpts[2]]  # 2 is now the least recently used
    assert cache.ids() == [1, 3]


def test_put_again_replaces_and_refreshes():
    cache, ckpts = _filled(2, 1, 2)
    again = _ckpt("a1 again")
    assert cache.put(1, again) == []
    assert cache.ids() == [2, 1] and cache.get(1) is again


def test_pinned_entries_are_never_evicted_even_above_capacity():
    cache, ckpts = _filled(2, 1, 2, max_pinned=3)
    cache.pin(1)
    assert cache.put(3, _ckpt("a3")) == [ckpts[2]]  # 1 is older but pinned: 2 goes
    cache.pin(3)
    newest = _ckpt("a4")
    assert cache.put(4, newest) == [newest]  # every other entry is pinned: the newcomer itself is not kept
    assert cache.ids() == [1, 3]
    cache.pin(4)
    assert cache.put(4, newest) == []  # pinned, it stays above capacity
    assert cache.ids() == [1, 3, 4] and len(cache) == 3
    cache.unpin(1)
    cache.unpin(4)
    evicted = cache.put(5, _ckpt("a5"))
    assert [c.name for c in evicted] == ["a1", "a4"] and cache.ids() == [3, 5]


def test_an_id_can_be_pinned_before_it_is_cached():
    cache, _ = _filled(1, 1)
    cache.pin(7)
    assert cache.is_pinned(7) and 7 not in cache
    loaded = _ckpt("a7")
    assert [c.name for c in cache.put(7, loaded)] == ["a1"]  # the pinned newcomer stays, the old one goes
    assert cache.get(7) is loaded


def test_at_most_max_pinned_ids_and_pinning_again_is_free():
    cache, _ = _filled(4, 1, 2, 3, max_pinned=2)
    cache.pin(1)
    cache.pin(2)
    assert cache.can_pin(1) and not cache.can_pin(3)
    cache.pin(1)  # already pinned: no new pin needed
    with pytest.raises(TooManyLoRAsError, match="max_loras=2.*remove_lora"):
        cache.pin(3)
    assert not cache.is_pinned(3)
    cache.unpin(2)
    assert cache.can_pin(3)


def test_discard_drops_the_entry_but_not_its_pin():
    cache, ckpts = _filled(2, 1, 2)
    cache.pin(1)
    assert cache.discard(1) is ckpts[1] and cache.discard(1) is None
    assert 1 not in cache and cache.is_pinned(1)
    cache.unpin(1)
    cache.unpin(1)  # unpinning what is not pinned is a no-op
    assert not cache.is_pinned(1)


@pytest.mark.parametrize("capacity, max_pinned", [(0, 1), (2, -1)])
def test_bad_sizes_are_refused(capacity, max_pinned):
    with pytest.raises(ConfigError, match="capacity >= 1"):
        HostCache(capacity, max_pinned=max_pinned)
