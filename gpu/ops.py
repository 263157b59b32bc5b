"""The device-op interface: one class per backend (TorchOps on the CPU, CudaOps with CuPy RawKernels).

The backend is chosen once at start-up (gpu/backend.py). Each method documents its meaning as
reference code; TorchOps is that reference, and the oracle the CUDA kernel tests compare to.

Shapes: T tokens in the step, B sequences, S adapter slots, R = max_lora_rank,
KV caches are [num_blocks, block_size, num_kv_heads, head_dim] per layer (one for K, one for V).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def slot_runs(slots: np.ndarray) -> np.ndarray:
    """Where each run of consecutive tokens with the same adapter slot starts (indices into `slots`).

    Both backends plan their LoRA work over these runs (TorchOps' segments, CudaOps' SGMV segments).
    """
    change = np.ones(slots.shape[0], dtype=bool)
    change[1:] = slots[1:] != slots[:-1]
    return np.flatnonzero(change)


class StepMemo:
    """Values derived from a step's index tensors alone, built at the first layer and reused by the others.

    A step passes the same ForwardBatch tensors to every layer. Tensors in a key are compared by
    identity and kept referenced until the next step replaces them, so a new step's tensor can never
    be mistaken for an old one at a reused address. The contract this relies on: callers build a
    step's index tensors fresh and never write to them in place between calls (ForwardBatch's
    tensors are made anew for every eager step; CUDA-graph steps write static buffers in place, so
    nothing a graph step reaches may be memoised).
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[tuple, object]] = {}

    def get(self, name: str, key: tuple, build: Callable[[], Any]) -> Any:
        held = self._held.get(name)
        if held is not None and len(held[0]) == len(key) and all(map(_same, held[0], key)):
            return held[1]
        value = build()
        self._held[name] = (key, value)
        return value


def _same(a: object, b: object) -> bool:
    """Tensors: the same object; anything else (ints, None): equal."""
    return a is b or (not isinstance(a, torch.Tensor) and a == b)


class LoraMeta:
    """Per-step LoRA indexing, built once by Ops.lora_prepare and shared by every layer and module.

    token_slots[t] is the adapter slot of token t, or -1 for the base model. Backends add what
    they need (segment tables for SGMV, sort permutations, ...).
    """

    token_slots: torch.Tensor  # [T] int32 on the device
    num_slots: int
    extra: dict[str, Any]

    def __init__(self, token_slots: torch.Tensor, num_slots: int, **extra: Any) -> None:
        self.token_slots = token_slots
        self.num_slots = num_slots
        self.extra = extra


class Ops(abc.ABC):
    name: str = "abstract"

    def lora_b_layout(self, model_dtype: torch.dtype, device: torch.device) -> str:
        """How the adapter slots of a `model_dtype` model should hold B for these ops
        (loraledger.lora.device_slots.LAYOUTS): one B per slice, the layout CUDA's kernels read."""
        return "slices"

    @abc.abstractmethod
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused residual add + RMSNorm.

        Semantics: `r = x if residual is None else x + residual`;
        `out = r * rsqrt(mean(r.float()**2, -1) + eps) * weight` (computed in fp32, cast to x.dtype);
        returns (out, r). x, residual: [T, H]; weight: [H].
        """

    @abc.abstractmethod
    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> None:
        """Rotate q [T, Hq, D] and k [T, Hk, D] in place (NeoX / HF Llama "rotate_half" style).

        cos_sin_cache: [max_pos, D] fp32, first D/2 columns cos, last D/2 sin, for each position.
        Semantics: with c, s = cache[positions] halves, x1, x2 = x[..., :D/2], x[..., D/2:]:
        `x = cat(x1*c - x2*s, x2*c + x1*s)`.
        """

    @abc.abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2I] -> silu(x[:, :I]) * x[:, I:]  ([T, I])."""

    @abc.abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store new keys/values: `k_cache.view(-1, Hk, D)[slot_mapping] = key` (same for v).

        key, value: [T, Hk, D]; slot_mapping: [T] int64, slot = block * block_size + offset.
        """

    @abc.abstractmethod
    def paged_attention_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One query token per sequence attends to its whole context in the paged cache.

        q: [B, Hq, D]; block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (context length,
        the query's own token included, its KV already written). GQA: query head h reads KV head
        h // (Hq // Hk). With sliding_window w, only the last w positions are attended. With softcap c,
        each score s becomes c * tanh(s / c) before the softmax (Gemma 2).
        Returns [B, Hq, D] in q's dtype (softmax in fp32).
        """

    @abc.abstractmethod
    def prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        sizes: tuple[int, int] | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention for query chunks that follow a cached prefix (softcap as in paged_attention_decode).

        q: [Tq, Hq, D], the queries of P sequences laid end to end (query_start_loc: [P+1] int32).
        Sequence p's queries are its last (query_start_loc[p+1]-query_start_loc[p]) positions of
        seq_lens[p]; each attends to every earlier position and itself, KV read from the cache.
        sizes: (longest query chunk, longest context) when the caller knows them on the host, so that
        a backend need not read them back from the device.
        """

    @abc.abstractmethod
    def lora_prepare(self, token_slots: torch.Tensor, num_slots: int) -> LoraMeta:
        """Build the per-step indexing once; token_slots: [T] int32, -1 = no adapter, on the host
        (the runner's case: the backend uploads what it needs) or on the device."""

    @abc.abstractmethod
    def lora_shrink(self, x: torch.Tensor, a_stack: torch.Tensor, meta: LoraMeta) -> torch.Tensor:
        """h = x @ A^T per token, for every slice of the fused module at once.

        x: [T, in]; a_stack: [S, n_slices * R, in]. Semantics (fp32 accumulation):
        `h[t] = a_stack[slot[t]] @ x[t]` for slot[t] >= 0, and `h[t] = 0` where slot[t] == -1.
        Returns h: [T, n_slices * R] in x's dtype.
        """

    @abc.abstractmethod
    def lora_expand(
        self,
        h: torch.Tensor,
        b_stack: torch.Tensor,
        meta: LoraMeta,
        slice_offsets: tuple[int, ...],
        y: torch.Tensor,
    ) -> None:
        """y += h @ B^T per token and slice, in place (the LoRA scale is already folded into B).

        h: [T, n_slices * R]; b_stack: [S, out_total, R]; slice_offsets: n_slices + 1 column
        offsets into y [T, out_total] (q/k/v or gate/up fused). Semantics, for slot[t] >= 0 and
        output column j of slice m (slice_offsets[m] <= j < slice_offsets[m+1]):
        `y[t, j] += sum_r h[t, m*R + r] * b_stack[slot[t], j, r]`; rows with slot -1 unchanged.
        A CPU backend may be given a block-diagonal b_stack [S, out_total, n_slices * R] instead (zeros outside
        each slice's rank columns, loraledger.lora.device_slots.LoraStack): the same delta as one slice of rank
        n_slices * R.
        """

    def lora_apply(
        self,
        x: torch.Tensor,
        a_stack: torch.Tensor,
        b_stack: torch.Tensor,
        meta: LoraMeta,
        slice_offsets: tuple[int, ...],
        y: torch.Tensor,
    ) -> None:
        """y += LoRA delta of x: lora_shrink then lora_expand, with the same semantics and shapes.

        A backend may fuse the two and keep the intermediate h in its own layout; the result must
        equal this composition within the dtype's rounding.
        """
        self.lora_expand(self.lora_shrink(x, a_stack, meta), b_stack, meta, slice_offsets, y)
