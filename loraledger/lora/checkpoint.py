"""LoraCheckpoint: one adapter in host memory, immutable, as the host cache, the scheduler and the device slots share it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loraledger.lora.slot_stacks import SlotStacks
from loraledger.sources.engine_sources import adapter_fields
from loraledger.store.records import AdapterRecord


@dataclass(frozen=True, eq=False)  # eq=False: identity hash, so it can key dicts despite the dict/tensor fields
class LoraCheckpoint:
    """An adapter in host memory: immutable once built, shared by the loader's LRU and the device slots.

    ``weights[(layer, module)] = (A [r, in_features], B [out_features, r])``, fp32, CPU and
    unscaled: the delta is ``scale * (x @ A.T) @ B.T``. A (layer, module) pair that is absent
    contributes nothing. When the checkpoint carries ``slot_stacks`` (every checkpoint
    load_lora_checkpoint returns does) the weights are views into them, so a cached adapter holds
    its tensors once; B is then contiguous only when r equals the stacks' max_lora_rank.
    """

    name: str
    int_id: int
    path: str
    fingerprint: str
    rank: int
    alpha: float
    use_rslora: bool
    scale: float  # alpha / r, or alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]  # the modules that carry tensors, in LORA_TARGETS order
    config: dict  # adapter_config.json as read
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    nbytes: int  # host memory the checkpoint's tensors hold
    # the weights laid out as a device slot holds them, built while loading so a slot load is a copy
    slot_stacks: SlotStacks | None = None
    # PEFT's rank_pattern / alpha_pattern: each (layer, module)'s own scale where it differs from `scale`
    module_scales: Mapping[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    max_rank: int = 0  # the largest rank of any module (rank_pattern may exceed r); 0: `rank`
    source: Any = None  # loraledger.sources.Source: the Hub repo, revision and commit it was read from (None: a folder)

    @property
    def slot_rank(self) -> int:
        """The rank a device slot must keep for this adapter: rows past it are zero padding."""
        return self.max_rank or self.rank

    def to_record(self, base_model_fingerprint: str, first_seen: float) -> AdapterRecord:
        return AdapterRecord(
            fingerprint=self.fingerprint,
            name=self.name,
            int_id=self.int_id,
            path=self.path,
            rank=self.rank,
            alpha=self.alpha,
            target_modules=list(self.target_modules),
            base_model_fingerprint=base_model_fingerprint,
            use_rslora=self.use_rslora,
            first_seen=first_seen,
            **adapter_fields(self.source),
        )
