"""LoraSlots: the device-resident adapter slots, stacked per fused module (qkv, o, gate_up, down) and layer."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from loraledger.errors import ConfigError
from loraledger.gpu import cpu_features
from loraledger.gpu.model_config import ModelConfig
from loraledger.lora.slot_stacks import FUSED_MODULES, fused_layout, stack_for_slots

# How B is held (Ops.lora_b_layout picks one for its kernels):
# "slices": [L, S, out_total, R] contiguous, row o of the slice it belongs to (CUDA's kernels read this);
# "block_diagonal": [L, S, out_total, n*R], slice m's rows hold its B in rank columns m*R..(m+1)*R and zeros
#   elsewhere, so that h [T, n*R] times B^T is the whole fused delta in one product (TorchOps without its CPU
#   kernel reads it as one slice of rank n*R) instead of one per slice;
# "rank_major": stored [L, S, R, out_total] (row r of every slice side by side), held as the transposed view
#   [L, S, out_total, R]: every reader sees the "slices" shape, and the CPU kernel (gpu/lora_cpu_kernel.py)
#   streams each rank row of a slot once for all its tokens.
LAYOUTS = ("slices", "block_diagonal", "rank_major")


@dataclass(frozen=True)
class LoraStack:
    """One fused module's slots for every layer: A [L, S, n*R, in], B [L, S, out_total, R] (scale folded in),
    B held in one of LAYOUTS."""

    a: torch.Tensor
    b: torch.Tensor
    slice_offsets: tuple[int, ...]
    layout: str = "slices"

    @property
    def block_diagonal(self) -> bool:
        return self.layout == "block_diagonal"

    @functools.cached_property
    def per_layer(self) -> list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]]:
        """(A [S, n*R, in], B [S, out_total, R], slice offsets) of each layer, as views made once: the slots are
        written in place, so these stay the stacks' own, and a step's forward makes no new views per module."""
        return [(a, b, self.slice_offsets) for a, b in zip(self.a.unbind(0), self.b.unbind(0))]

    def slice_b(self, m: int) -> torch.Tensor:
        """Slice m's B [L, S, out_m, R] (a view), whatever the layout."""
        lo, hi = self.slice_offsets[m], self.slice_offsets[m + 1]
        if not self.block_diagonal:
            return self.b[:, :, lo:hi]
        rank = self.a.shape[2] // (len(self.slice_offsets) - 1)
        return self.b[:, :, lo:hi, m * rank : (m + 1) * rank]


class LoraSlots:
    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        layout: str = "slices",
    ) -> None:
        """`layout`: how each fused module's B is held (LAYOUTS; the ops' choice, Ops.lora_b_layout); a
        block-diagonal B only for modules of more than one slice."""
        if max_loras < 1 or max_lora_rank < 1:
            raise ConfigError(f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1")
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown LoRA B layout {layout!r}: use one of {', '.join(LAYOUTS)}")
        self.config = config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = torch.device(device)
        self.dtype = slot_dtype(dtype, self.device)
        layers, r = config.num_hidden_layers, max_lora_rank
        self.stacks: dict[str, LoraStack] = {}
        for group, modules in FUSED_MODULES.items():
            in_features, offsets = fused_layout(config, group)
            n = len(modules)
            held = "slices" if layout == "block_diagonal" and n == 1 else layout
            self.stacks[group] = LoraStack(
                a=torch.zeros((layers, max_loras, n * r, in_features), dtype=self.dtype, device=self.device),
                b=_b_stack(held, (layers, max_loras, offsets[-1], r), n, self.dtype, self.device),
                slice_offsets=offsets,
                layout=held,
            )
        self._targets: list[frozenset[str]] = [frozenset()] * max_loras
        self.fingerprints: list[str | None] = [None] * max_loras
        # each slot's adapter rank (0: free): rank rows past it are zero padding, which the CUDA kernels
        # skip (a rank-8 adapter in rank-64 slots reads an eighth of the padded bytes)
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=self.device)

    def rank_table(self) -> dict[str, object]:
        """The LoraMeta extension that lets the ops skip each slot's zero rank rows: slot_ranks and max_rank."""
        return {"slot_ranks": self.ranks, "max_rank": self.max_lora_rank}

    def layer(self, layer: int, group: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(A [S, n*R, in], B [S, out_total, R], slice offsets) of one fused module in one layer."""
        return self.stacks[group].per_layer[layer]

    def targets(self, slot: int) -> frozenset[str]:
        """The fused modules the adapter in `slot` changes (empty when the slot is free)."""
        return self._targets[slot]

    def groups_for(self, active_slots: Iterable[int]) -> frozenset[str]:
        """The fused modules that at least one of the given slots targets: the others can skip LoRA work."""
        out: set[str] = set()
        for slot in active_slots:
            out |= self._targets[slot]
        return frozenset(out)

    def load(self, slot: int, ckpt: object, fingerprint: str | None = None) -> None:
        """Copy an adapter into `slot`: A zero-padded to max_lora_rank, B pre-multiplied by the adapter's scale.

        `ckpt` is a LoraCheckpoint (loraledger.lora.checkpoint); modules it does not target are zeroed.
        A checkpoint loaded for this max_lora_rank carries its slot-ready stacks (built by the adapter
        loader's thread, off the step), so this is a copy of A and a scaled copy of B per fused module;
        otherwise they are built here. B is scaled in fp32 before any cast to the slots' dtype.
        """
        self._check_slot(slot)
        stacked = getattr(ckpt, "slot_stacks", None)
        if stacked is None or stacked.rank != self.max_lora_rank:
            stacked = stack_for_slots(self.config, self.max_lora_rank, ckpt)
        for group, stack in self.stacks.items():
            pair = stacked.groups.get(group)
            if pair is None:
                stack.a[:, slot].zero_()
                stack.b[:, slot].zero_()
            else:
                stack.a[:, slot].copy_(pair[0])
                scales = stacked.slice_scales.get(group)
                if scales is None and not stack.block_diagonal:
                    _copy_scaled(stack.b[:, slot], pair[1], stacked.scale)
                else:  # per-module scales (PEFT alpha_pattern / rank_pattern), or a block-diagonal B: slice by slice
                    offsets = stack.slice_offsets
                    for m in range(len(offsets) - 1):
                        lo, hi = offsets[m], offsets[m + 1]
                        scale = stacked.scale if scales is None else scales[:, m, None, None]
                        _copy_scaled(stack.slice_b(m)[:, slot], pair[1][:, lo:hi], scale)
        self._targets[slot] = frozenset(stacked.groups)
        self.fingerprints[slot] = fingerprint if fingerprint is not None else getattr(ckpt, "fingerprint", None)
        rank = getattr(ckpt, "slot_rank", None) or getattr(ckpt, "rank", self.max_lora_rank)
        self.ranks[slot] = min(int(rank), self.max_lora_rank)

    def clear(self, slot: int) -> None:
        """Free `slot`: zero its tensors so a stale adapter can never leak into a later step."""
        self._check_slot(slot)
        for stack in self.stacks.values():
            stack.a[:, slot].zero_()
            stack.b[:, slot].zero_()
        self._targets[slot] = frozenset()
        self.fingerprints[slot] = None
        self.ranks[slot] = 0

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ConfigError(f"adapter slot {slot} is out of range: the engine has max_loras={self.max_loras} slots")


def _b_stack(layout: str, shape: tuple[int, int, int, int], n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros for B in `layout`: [L, S, out_total, R] ("slices"; the transposed view of rank-major storage) or
    [L, S, out_total, n*R] ("block_diagonal")."""
    layers, slots, out_total, rank = shape
    if layout == "rank_major":
        return torch.zeros((layers, slots, rank, out_total), dtype=dtype, device=device).transpose(-1, -2)
    width = n * rank if layout == "block_diagonal" else rank
    return torch.zeros((layers, slots, out_total, width), dtype=dtype, device=device)


def slot_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the slots hold adapters in: the model's, except a reduced dtype on a CPU that emulates it.

    On a CPU that multiplies bf16 natively (cpu_features.native_bf16) bf16 slots stream half the bytes of fp32
    ones and the grouped products with block-diagonal B run as fast as fp32's (bench/RESULTS.md, "Where a mixed
    bf16 step goes"). Elsewhere (emulated bf16, and fp16) the CPU's small batched products are about twice as
    fast in fp32: the adapters stay fp32 and only the step's few activation rows are converted, never a copy of
    the adapter weights per step. CUDA keeps the model dtype (its kernels read bf16 stacks).
    """
    if device.type != "cpu" or model_dtype not in (torch.bfloat16, torch.float16):
        return model_dtype
    if model_dtype == torch.bfloat16 and cpu_features.native_bf16():
        return model_dtype
    return torch.float32


def _copy_scaled(dst: torch.Tensor, src: torch.Tensor, scale: float | torch.Tensor) -> None:
    """dst = src * scale (a number, or a host fp32 tensor that broadcasts over src), the product taken in
    src's fp32 and rounded once into dst's dtype.

    On one device the product is written straight into dst (torch computes in fp32 and casts on the
    store); across devices it is formed on src's side, as the scaled host copy was before.
    """
    if dst.device == src.device:
        torch.mul(src, scale, out=dst)
    else:
        dst.copy_(src * scale)
