"""AdapterRegistry: one folder per id and per name, in-place reloads, resumed requests' ids, forgetting."""

from __future__ import annotations

import pytest

from loraledger.errors import LoRARequestConflictError
from loraledger.lora.registry import RESUMED_IDS_BELOW, AdapterRegistry
from loraledger.lora.request import LoRARequest


def test_register_keeps_the_first_request_per_id_and_lists_ids_sorted():
    reg = AdapterRegistry()
    first = LoRARequest("a", 2, "/a", base_model_name="base")
    reg.register(first)
    reg.register(LoRARequest("a", 2, "/a"))  # the same adapter again: nothing changes
    reg.register(LoRARequest("b", 1, "/b"))
    assert reg.get(2) is first and reg.get(2).base_model_name == "base"
    assert reg.ids() == [1, 2] and 1 in reg and 3 not in reg and reg.get(3) is None


def test_an_id_reused_for_another_path_is_refused_naming_both():
    reg = AdapterRegistry()
    reg.register(LoRARequest("a", 1, "/a"))
    with pytest.raises(LoRARequestConflictError, match="lora_int_id 1 .*'/a'.*'/other'.*load_inplace=True"):
        reg.register(LoRARequest("a", 1, "/other"))
    with pytest.raises(LoRARequestConflictError, match="lora_int_id 1"):
        reg.register(LoRARequest("b", 1, "/other"))
    assert reg.get(1).lora_path == "/a"


def test_a_name_reused_for_another_path_is_refused():
    reg = AdapterRegistry()
    reg.register(LoRARequest("a", 1, "/a"))
    with pytest.raises(LoRARequestConflictError, match="lora_name 'a' .*'/a'.*'/b'"):
        reg.register(LoRARequest("a", 2, "/b"))
    assert reg.ids() == [1]


def test_a_second_id_for_the_same_name_and_path_is_allowed():
    reg = AdapterRegistry()
    reg.register(LoRARequest("a", 1, "/a"))
    reg.register(LoRARequest("a", 2, "/a"))
    assert reg.ids() == [1, 2]
    reg.remove(2)  # the name still maps to 1
    with pytest.raises(LoRARequestConflictError, match="lora_name 'a'"):
        reg.register(LoRARequest("a", 3, "/b"))


def test_an_inplace_reload_under_the_same_name_may_change_the_folder():
    reg = AdapterRegistry()
    reg.register(LoRARequest("a", 1, "/a"))
    reg.register(LoRARequest("a", 1, "/a2", load_inplace=True))
    kept = reg.get(1)
    # the registry keeps the adapter, not the one-off ask to read it again
    assert kept.lora_path == "/a2" and kept.load_inplace is False
    with pytest.raises(LoRARequestConflictError, match="lora_int_id 1"):
        reg.register(LoRARequest("other", 1, "/x", load_inplace=True))  # another name: not a reload


def test_an_inplace_request_for_a_new_id_registers_without_the_flag():
    reg = AdapterRegistry()
    reg.register(LoRARequest("a", 1, "/a", load_inplace=True))
    assert reg.get(1) == LoRARequest("a", 1, "/a") and reg.get(1).load_inplace is False


def test_remove_forgets_id_and_name():
    reg = AdapterRegistry()
    reg.register(LoRARequest("a", 1, "/a"))
    assert reg.remove(1).lora_path == "/a" and reg.remove(1) is None
    reg.register(LoRARequest("a", 5, "/elsewhere"))  # the name is free again
    assert reg.ids() == [5]


def test_forget_only_the_adapter_the_id_still_names():
    reg = AdapterRegistry()
    reg.register(LoRARequest("a", 1, "/a"))
    assert reg.forget(LoRARequest("b", 1, "/b")) is False  # id 1 names "a", not this one
    assert reg.forget(LoRARequest("a", 1, "/a")) is True
    assert reg.ids() == [] and reg.forget(LoRARequest("a", 1, "/a")) is False
    reg.register(LoRARequest("a", 1, "/fixed"))  # a corrected folder may be registered again
    assert reg.get(1).lora_path == "/fixed"


def test_a_resumed_adapter_takes_the_local_id_of_the_same_name_and_path():
    reg = AdapterRegistry()
    reg.register(LoRARequest("a", 4, "/a"))
    assert reg.for_resume(LoRARequest("a", 1, "/a")) == LoRARequest("a", 4, "/a")
    assert reg.for_resume(LoRARequest("a", 1, "/a")).lora_int_id == 4


def test_a_resumed_adapter_unknown_here_takes_the_highest_free_id():
    reg = AdapterRegistry()
    reg.register(LoRARequest("x", RESUMED_IDS_BELOW - 1, "/x"))
    got = reg.for_resume(LoRARequest("a", 1, "/a"))
    assert (got.lora_name, got.lora_int_id, got.lora_path) == ("a", RESUMED_IDS_BELOW - 2, "/a")
    other_path = reg.for_resume(LoRARequest("x", 1, "/moved"))  # same name, another folder: not the same adapter
    assert other_path.lora_int_id == RESUMED_IDS_BELOW - 2
    assert reg.ids() == [RESUMED_IDS_BELOW - 1]  # for_resume registers nothing
