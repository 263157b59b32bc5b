"""SlotStacks: one adapter laid out as a device slot holds it (per fused module, every layer, padded to max_lora_rank)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from loraledger.errors import AdapterRankError, AdapterShapeError, AdapterTargetError
from loraledger.gpu.model_config import ModelConfig

# fused module -> the HF linear layers it holds, in column order
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULE_GROUP = {module: group for group, modules in FUSED_MODULES.items() for module in modules}


def fused_layout(config: ModelConfig, group: str) -> tuple[int, tuple[int, ...]]:
    """(in_features, column offset of each member's output slice plus the total) of one fused module."""
    shapes = config.module_shapes()
    modules = FUSED_MODULES[group]
    return shapes[modules[0]][0], tuple(itertools.accumulate((shapes[m][1] for m in modules), initial=0))


@dataclass(frozen=True)
class SlotStacks:
    """One adapter laid out as a slot holds it: per targeted fused module, A [L, n*R, in] and B
    [L, out_total, R], zero-padded to R = max_lora_rank (fp32, host memory). B is stored as the adapter
    has it; LoraSlots.load multiplies it by `scale` on the way into a slot, so that the same tensors can
    also serve as the checkpoint's own weights (LoraCheckpoint.weights are views into them). Fused
    modules the adapter does not target are absent."""

    rank: int  # the max_lora_rank R the tensors are padded to
    scale: float  # the adapter's scale, applied to B in the slot
    groups: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # each (layer, module) of the adapter as views into `groups`: (A [r, in], B [out, r]), the
    # adapter's own tensors without a second copy of them (what LoraCheckpoint.weights become)
    module_views: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # PEFT rank_pattern / alpha_pattern adapters: per fused module, the scale of each (layer, slice)
    # [L, n_slices] fp32, used instead of `scale` for that module's B
    slice_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.groups.values())

    def largest_scale(self, group: str) -> float:
        """The largest scale any slice of `group`'s B is multiplied by."""
        scales = self.slice_scales.get(group)
        return self.scale if scales is None else float(scales.abs().max())


def stack_for_slots(config: ModelConfig, max_lora_rank: int, ckpt: object) -> SlotStacks:
    """Validate an adapter against the base model and lay it out for LoraSlots.load (pure; thread-safe).

    Raises AdapterRankError, AdapterTargetError or AdapterShapeError, naming the adapter.
    """
    name, path = getattr(ckpt, "name", None), getattr(ckpt, "path", None)
    rank = int(ckpt.rank)
    if rank > max_lora_rank:
        raise AdapterRankError(
            f"adapter rank {rank} is above max_lora_rank {max_lora_rank}; start the engine with a larger max_lora_rank",
            lora_name=name,
            lora_path=path,
        )
    unknown = set(ckpt.target_modules) - set(MODULE_GROUP)
    if unknown:
        raise AdapterTargetError(
            f"adapter targets {sorted(unknown)}, LoRA can only be applied to {list(MODULE_GROUP)}",
            lora_name=name,
            lora_path=path,
        )
    shapes = config.module_shapes()
    layers, r, scale = config.num_hidden_layers, max_lora_rank, float(ckpt.scale)
    module_scales = getattr(ckpt, "module_scales", None) or {}
    groups: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    views: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    slice_scales: dict[str, torch.Tensor] = {}
    for group, modules in FUSED_MODULES.items():
        if not any(module in ckpt.target_modules for module in modules):
            continue
        in_features, offsets = fused_layout(config, group)
        a_host = torch.zeros((layers, len(modules) * r, in_features), dtype=torch.float32)
        b_host = torch.zeros((layers, offsets[-1], r), dtype=torch.float32)
        for m, module in enumerate(modules):
            if module not in ckpt.target_modules:
                continue
            in_f, out_f = shapes[module]
            lo = offsets[m]
            for layer in range(layers):
                pair = ckpt.weights.get((layer, module))
                if pair is None:
                    continue  # PEFT layers_to_transform: this layer keeps the base weights
                a, b = pair
                r_mod = a.shape[0]  # PEFT rank_pattern may give a module its own rank
                if r_mod > r or tuple(a.shape) != (r_mod, in_f) or tuple(b.shape) != (out_f, r_mod):
                    raise AdapterShapeError(
                        f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                        f"the base model (expected ({r_mod}, {in_f}) / ({out_f}, {r_mod}), rank <= {r})",
                        lora_name=name,
                        lora_path=path,
                    )
                a_view, b_view = a_host[layer, m * r : m * r + r_mod], b_host[layer, lo : lo + out_f, :r_mod]
                a_view.copy_(a)
                b_view.copy_(b)
                views[layer, module] = (a_view, b_view)
        groups[group] = (a_host, b_host)
        if any((layer, module) in module_scales for layer in range(layers) for module in modules):
            slice_scales[group] = torch.tensor(
                [[module_scales.get((layer, module), scale) for module in modules] for layer in range(layers)],
                dtype=torch.float32,
            )
    return SlotStacks(rank=max_lora_rank, scale=scale, groups=groups, module_views=views, slice_scales=slice_scales)
