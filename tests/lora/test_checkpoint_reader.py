"""load_lora_checkpoint on real PEFT adapters of a tiny Llama: the weights and scales it reads, and its typed errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loraledger.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterShapeError,
)
from loraledger.lora.checkpoint_reader import fingerprint_adapter
from tests.lora.adapter_folders import copy_folder, load_adapter, raises_for, save_adapter

# ---- loading ---------------------------------------------------------------------------------


def test_weights_equal_peft_state_dict(adapter, model_config):
    folder, state = adapter
    ckpt = load_adapter(folder, model_config)
    assert ckpt.target_modules == ("q_proj", "v_proj", "down_proj")
    assert set(ckpt.weights) == {(layer, m) for layer in range(2) for m in ckpt.target_modules}
    for (layer, module), (a, b) in ckpt.weights.items():
        block = "mlp" if module == "down_proj" else "self_attn"
        prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
        assert a.dtype == b.dtype == torch.float32 and a.is_contiguous()
        torch.testing.assert_close(a, state[f"{prefix}.lora_A.weight"], rtol=0, atol=0)
        torch.testing.assert_close(b, state[f"{prefix}.lora_B.weight"], rtol=0, atol=0)
        assert a.shape[0] == b.shape[1] == 4
    # slot-ready stacks are built while loading: q/k/v and down targeted, o and gate/up absent
    stacks = ckpt.slot_stacks
    assert set(stacks.groups) == {"qkv", "down"}
    a_qkv, b_qkv = stacks.groups["qkv"]
    r, q = stacks.rank, model_config.q_size
    torch.testing.assert_close(a_qkv[1, :4], ckpt.weights[(1, "q_proj")][0], rtol=0, atol=0)
    assert not a_qkv[:, 4:r].any() and not a_qkv[:, r : 2 * r].any()  # rank padding; k_proj untargeted
    torch.testing.assert_close(b_qkv[0, :q, :4], ckpt.weights[(0, "q_proj")][1], rtol=0, atol=0)  # unscaled:
    assert stacks.scale == ckpt.scale  # LoraSlots.load applies it
    # the tensors are held once: the weights are views into the stacks, and nbytes counts the stacks alone
    stack_storages = {t.untyped_storage().data_ptr() for pair in stacks.groups.values() for t in pair}
    assert all(t.untyped_storage().data_ptr() in stack_storages for pair in ckpt.weights.values() for t in pair)
    assert ckpt.nbytes == sum(a.nbytes + b.nbytes for a, b in stacks.groups.values())
    record = ckpt.to_record("base-fp", 12.5)
    assert (record.fingerprint, record.rank, record.alpha, record.target_modules, record.first_seen) == (
        ckpt.fingerprint,
        4,
        8.0,
        ["q_proj", "v_proj", "down_proj"],
        12.5,
    )


def test_slots_get_each_b_times_the_scale_rounded_once_from_the_views(model_config, tmp_path):
    from loraledger.lora.device_slots import LoraSlots

    # r=4 below max_lora_rank=8, so the B views are strided; scale 7/4 rounds in bf16
    folder, state = save_adapter(tmp_path / "a7", lora_alpha=7)
    ckpt = load_adapter(folder, model_config, max_lora_rank=8)
    _, b = ckpt.weights[(1, "v_proj")]
    assert not b.is_contiguous() and ckpt.scale == 7 / 4
    torch.testing.assert_close(
        b, state["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"], rtol=0, atol=0
    )
    for dtype in (torch.bfloat16, torch.float32):
        slots = LoraSlots(
            model_config, max_loras=2, max_lora_rank=8, dtype=dtype, device="cpu", layout="block_diagonal"
        )
        slots.load(1, ckpt)
        v_b = slots.stacks["qkv"].slice_b(2)[1, 1]  # v's B in layer 1, slot 1
        assert torch.equal(v_b[:, :4], (b * ckpt.scale).to(slots.dtype)) and v_b[:, 4:].count_nonzero() == 0


def test_scale_plain_and_rslora(adapter, model_config, tmp_path):
    assert load_adapter(adapter[0], model_config).scale == pytest.approx(8 / 4)
    folder, _ = save_adapter(tmp_path / "rs", r=8, lora_alpha=16, use_rslora=True)
    ckpt = load_adapter(folder, model_config)
    assert ckpt.use_rslora and ckpt.scale == pytest.approx(16 / math.sqrt(8))


def test_half_precision_tensors_become_fp32(adapter, model_config, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_folder(adapter[0], tmp_path / "bf16")
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(folder / "adapter_model.safetensors").items()}
    save_file(tensors, folder / "adapter_model.safetensors")
    ckpt = load_adapter(folder, model_config)
    a, _ = ckpt.weights[(0, "q_proj")]
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].float())


def test_adapter_name_segment_and_regex_and_all_linear_targets(adapter, model_config, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_folder(adapter[0], tmp_path / "named")
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file(
        {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}, folder / "adapter_model.safetensors"
    )
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["target_modules"] = r"model\.layers\.\d+\.(self_attn\.(q|v)_proj|mlp\.down_proj)"
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    assert load_adapter(folder, model_config).target_modules == ("q_proj", "v_proj", "down_proj")

    all_linear, _ = save_adapter(tmp_path / "all", target_modules="all-linear")
    ckpt = load_adapter(all_linear, model_config)
    assert ckpt.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_loads_concurrently_in_worker_threads(adapter, model_config):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        ckpts = list(pool.map(lambda _: load_adapter(adapter[0], model_config), range(4)))
    assert len({c.fingerprint for c in ckpts}) == 1
    for c in ckpts[1:]:
        assert all(torch.equal(c.weights[k][1], ckpts[0].weights[k][1]) for k in c.weights)


# ---- errors ----------------------------------------------------------------------------------


def test_missing_files(adapter, model_config, tmp_path):
    raises_for(AdapterNotFoundError, tmp_path / "nowhere", model_config, "does not exist")
    (tmp_path / "file").write_text("x")
    raises_for(AdapterNotFoundError, tmp_path / "file", model_config, "not a directory")
    no_config = copy_folder(adapter[0], tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    raises_for(AdapterNotFoundError, no_config, model_config, "adapter_config.json is missing")
    no_weights = copy_folder(adapter[0], tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    raises_for(AdapterNotFoundError, no_weights, model_config, "adapter_model.safetensors is missing")
    (no_weights / "adapter_model.bin").write_bytes(b"pickle")
    raises_for(
        AdapterNotFoundError, no_weights, model_config, "only adapter_model.safetensors is supported", "save_file"
    )
    with pytest.raises(AdapterNotFoundError):
        fingerprint_adapter(str(tmp_path / "nowhere"))


def _with_one_value(tmp_path: Path, pick, value: float) -> tuple[Path, str]:
    """A fresh adapter whose tensor `pick(sorted names)` has `value` at [0, 0]; its folder and that name."""
    folder = save_adapter(tmp_path / "edited")[0]
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = pick(sorted(tensors))
    tensors[name][0, 0] = value
    save_file(tensors, str(path))
    return folder, name


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(model_config, tmp_path, value):
    folder, name = _with_one_value(tmp_path, lambda names: names[1], value)
    raises_for(AdapterFormatError, folder, model_config, repr(name), "NaN or infinite", "re-train or re-export")


def test_scaled_b_overflowing_fp32_is_refused(model_config, tmp_path):
    # lora_alpha 8 / r 4: B is doubled in the slots, so 3e38 (finite in fp32) becomes 6e38
    folder, _ = _with_one_value(tmp_path, lambda names: next(n for n in names if "lora_B" in n), 3e38)
    raises_for(AdapterFormatError, folder, model_config, "overflows fp32")


def test_wrong_shapes_for_another_base_model(model_config, tmp_path):
    folder, _ = save_adapter(tmp_path / "wide", model_overrides={"hidden_size": 48})
    raises_for(AdapterShapeError, folder, model_config, "different base model")
    deep, _ = save_adapter(tmp_path / "deep", model_overrides={"num_hidden_layers": 3})
    raises_for(AdapterShapeError, deep, model_config, "layer 2")


def test_missing_half_of_a_pair(adapter, model_config, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_folder(adapter[0], tmp_path / "half")
    tensors = load_file(folder / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    save_file(tensors, folder / "adapter_model.safetensors")
    raises_for(AdapterShapeError, folder, model_config, "no lora_B")
