"""LoraSlots: adapters copied into stacked fused slots, A zero-padded, scale folded into B, clear and errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loraledger.errors import AdapterRankError, AdapterShapeError, AdapterTargetError, ConfigError
from loraledger.lora.device_slots import LoraSlots


def _ckpt(cfg, rank, modules, scale=2.0, layers=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = cfg.module_shapes()
    weights = {
        (layer, m): (torch.randn(rank, shapes[m][0], generator=g), torch.randn(shapes[m][1], rank, generator=g))
        for layer in (layers if layers is not None else range(cfg.num_hidden_layers))
        for m in modules
    }
    return SimpleNamespace(
        name="t", path="/t", rank=rank, scale=scale, target_modules=tuple(modules), weights=weights, fingerprint="fp"
    )


def test_load_places_padded_a_and_scaled_b_per_fused_slice(tiny_llama):
    cfg = tiny_llama.config
    slots = LoraSlots(cfg, max_loras=3, max_lora_rank=8, dtype=torch.float32, device="cpu", layout="block_diagonal")
    ckpt = _ckpt(cfg, 4, ["k_proj", "up_proj"], scale=0.5)
    slots.load(1, ckpt)
    a, b, offsets = slots.layer(1, "qkv")
    assert offsets == (0, cfg.q_size, cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size)
    ka, kb = ckpt.weights[(1, "k_proj")]
    assert torch.equal(a[1, 8:12], ka) and a[1, 12:16].count_nonzero() == 0  # k slice, rank padded to 8
    assert a[1, :8].count_nonzero() == 0 and a[1, 16:].count_nonzero() == 0  # q and v untouched
    # a fused module's B block-diagonal (TorchOps' layout): slice m's rows in rank columns m*8..(m+1)*8
    assert slots.stacks["qkv"].block_diagonal and b.shape[-1] == 3 * 8
    k_b = slots.stacks["qkv"].slice_b(1)[1, 1]  # layer 1, slot 1
    assert torch.equal(k_b[:, :4], kb * 0.5) and k_b[:, 4:].count_nonzero() == 0  # rank padded to 8
    assert b[1].count_nonzero() == kb.count_nonzero()  # q and v, and the off-diagonal blocks, stay zero
    ua, ub = ckpt.weights[(1, "up_proj")]
    ga, gb, goff = slots.layer(1, "gate_up")
    assert torch.equal(ga[1, 8:12], ua) and torch.equal(slots.stacks["gate_up"].slice_b(1)[1, 1, :, :4], ub * 0.5)
    assert gb[1].count_nonzero() == ub.count_nonzero()
    assert slots.targets(1) == {"qkv", "gate_up"} and slots.targets(0) == frozenset()
    assert slots.groups_for([0, 1]) == {"qkv", "gate_up"} and slots.fingerprints[1] == "fp"
    for stack in slots.stacks.values():  # the other slots stay zero
        assert stack.a[:, [0, 2]].count_nonzero() == 0 and stack.b[:, [0, 2]].count_nonzero() == 0


def test_scale_is_applied_in_fp32_then_rounded_once_to_the_slot_dtype(tiny_llama):
    from loraledger.lora.slot_stacks import stack_for_slots

    cfg = tiny_llama.config
    scale = 16 / 8**0.5  # not a power of two: scaling after the cast would round twice
    ckpt = _ckpt(cfg, 8, ["q_proj"], scale=scale, seed=3)
    _, qb = ckpt.weights[(0, "q_proj")]
    for dtype, layout in (
        (torch.bfloat16, "block_diagonal"),
        (torch.float32, "block_diagonal"),
        (torch.float32, "slices"),
        (torch.bfloat16, "rank_major"),
        (torch.float32, "rank_major"),
    ):
        slots = LoraSlots(cfg, max_loras=1, max_lora_rank=8, dtype=dtype, device="cpu", layout=layout)
        for source in (ckpt, SimpleNamespace(**{**vars(ckpt), "slot_stacks": stack_for_slots(cfg, 8, ckpt)})):
            slots.load(0, source)
            assert torch.equal(slots.stacks["qkv"].slice_b(0)[0, 0], (qb * scale).to(slots.dtype))


def test_rank_major_b_is_the_slices_b_stored_rank_row_by_rank_row(tiny_llama):
    """The rank-major layout (the CPU kernel's) holds the same B as "slices", seen through a transposed view: the
    storage is [L, S, R, out_total] with row r of every slice side by side."""
    cfg = tiny_llama.config
    ckpt = _ckpt(cfg, 4, ["q_proj", "v_proj", "gate_proj", "down_proj"], scale=0.5, seed=5)
    plain = LoraSlots(cfg, max_loras=2, max_lora_rank=8, dtype=torch.float32, device="cpu")
    rank_major = LoraSlots(cfg, max_loras=2, max_lora_rank=8, dtype=torch.float32, device="cpu", layout="rank_major")
    for slots in (plain, rank_major):
        slots.load(1, ckpt)
    for group, stack in rank_major.stacks.items():
        a, b, _ = rank_major.layer(1, group)
        pa, pb, _ = plain.layer(1, group)
        assert torch.equal(a, pa) and torch.equal(b, pb) and b.shape == pb.shape
        out_total, rank = b.shape[1:]
        assert b.stride() == (rank * out_total, 1, out_total)  # each rank row contiguous over every output
        assert stack.layout == "rank_major"
    assert rank_major.stacks["gate_up"].b.count_nonzero() > 0
    rank_major.clear(1)
    assert all(s.b.count_nonzero() == 0 and s.a.count_nonzero() == 0 for s in rank_major.stacks.values())


def test_an_unknown_layout_is_refused(tiny_llama):
    with pytest.raises(ConfigError, match="unknown LoRA B layout 'diagonal'"):
        LoraSlots(tiny_llama.config, max_loras=1, max_lora_rank=8, dtype=torch.float32, device="cpu", layout="diagonal")


def test_reload_replaces_and_clear_zeroes(tiny_llama):
    cfg = tiny_llama.config
    slots = LoraSlots(cfg, max_loras=2, max_lora_rank=8, dtype=torch.bfloat16, device="cpu")
    slots.load(0, _ckpt(cfg, 8, ["q_proj", "down_proj"]))
    slots.load(0, _ckpt(cfg, 2, ["o_proj"], layers=[0]))  # layer 1 not adapted by this one
    assert slots.targets(0) == {"o"}
    assert slots.stacks["qkv"].a.count_nonzero() == 0 and slots.stacks["down"].b.count_nonzero() == 0
    assert slots.stacks["o"].a[1].count_nonzero() == 0 and slots.stacks["o"].a[0, 0, :2].count_nonzero() > 0
    slots.clear(0)
    assert all(s.a.count_nonzero() == 0 and s.b.count_nonzero() == 0 for s in slots.stacks.values())
    assert slots.targets(0) == frozenset() and slots.fingerprints[0] is None


def test_a_layers_views_are_made_once_and_see_every_load_and_clear(tiny_llama):
    """layer() hands out the same views of the stacks at every call (a step makes no new views), and they see the
    loads and clears that come after they were first handed out: the slots are written in place."""
    cfg = tiny_llama.config
    slots = LoraSlots(cfg, max_loras=2, max_lora_rank=8, dtype=torch.float32, device="cpu", layout="rank_major")
    a, b, _ = slots.layer(1, "qkv")
    assert slots.layer(1, "qkv")[0] is a and slots.layer(1, "qkv")[1] is b
    assert a.count_nonzero() == 0 and b.count_nonzero() == 0
    ckpt = _ckpt(cfg, 4, ["q_proj"], scale=1.0)
    slots.load(1, ckpt)
    qa, qb = ckpt.weights[(1, "q_proj")]
    assert torch.equal(a[1, :4], qa) and torch.equal(b[1, : cfg.q_size, :4], qb)
    assert torch.equal(a, slots.stacks["qkv"].a[1]) and torch.equal(b, slots.stacks["qkv"].b[1])
    slots.clear(1)
    assert a.count_nonzero() == 0 and b.count_nonzero() == 0


def test_errors(tiny_llama):
    cfg = tiny_llama.config
    slots = LoraSlots(cfg, max_loras=2, max_lora_rank=4, dtype=torch.float32, device="cpu")
    with pytest.raises(AdapterRankError, match="max_lora_rank"):
        slots.load(0, _ckpt(cfg, 8, ["q_proj"]))
    with pytest.raises(AdapterTargetError, match="lm_head"):
        slots.load(0, SimpleNamespace(**{**vars(_ckpt(cfg, 2, ["q_proj"])), "target_modules": ("q_proj", "lm_head")}))
    bad = _ckpt(cfg, 2, ["v_proj"])
    bad.weights[(0, "v_proj")] = (torch.zeros(2, 3), torch.zeros(cfg.kv_size, 2))
    with pytest.raises(AdapterShapeError, match="v_proj"):
        slots.load(0, bad)
    with pytest.raises(ConfigError, match="slot 2"):
        slots.load(2, _ckpt(cfg, 2, ["q_proj"]))


@pytest.mark.parametrize("native", [True, False])
def test_slot_dtype_is_bf16_on_the_cpu_only_where_bf16_is_native(native, monkeypatch):
    from loraledger.gpu import cpu_features
    from loraledger.lora.device_slots import slot_dtype

    monkeypatch.setattr(cpu_features, "native_bf16", lambda: native)
    cpu = torch.device("cpu")
    assert slot_dtype(torch.bfloat16, cpu) == (torch.bfloat16 if native else torch.float32)
    assert slot_dtype(torch.float16, cpu) == torch.float32 and slot_dtype(torch.float32, cpu) == torch.float32
    assert slot_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
