"""KVCache: the paged key/value cache, per layer one K and one V tensor [num_blocks, block_size, Hk, D]."""

from __future__ import annotations

import torch

from loraledger.gpu.model_config import ModelConfig


class KVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_hidden_layers, 2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # one allocation for all layers; zeroed so that never-written slots hold finite values
        self._storage = torch.zeros(shape, dtype=dtype, device=device)
        self.k_caches: list[torch.Tensor] = [self._storage[i, 0] for i in range(shape[0])]
        self.v_caches: list[torch.Tensor] = [self._storage[i, 1] for i in range(shape[0])]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Device bytes one block costs across all layers (K and V)."""
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()
