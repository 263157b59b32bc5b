"""KVCache: per-layer paged K/V tensors and the per-block byte cost."""

from __future__ import annotations

import torch

from loraledger.gpu.kv_cache import KVCache


def test_layout_and_bytes_per_block(tiny_llama):
    cfg = tiny_llama.config
    kv = KVCache(cfg, num_blocks=10, block_size=4, dtype=torch.bfloat16, device="cpu")
    assert len(kv.k_caches) == len(kv.v_caches) == cfg.num_hidden_layers
    assert kv.k_caches[1].shape == (10, 4, cfg.num_key_value_heads, cfg.head_dim)
    per_block = KVCache.bytes_per_block(cfg, 4, torch.bfloat16)
    assert per_block == 2 * cfg.num_hidden_layers * 4 * cfg.num_key_value_heads * cfg.head_dim * 2
    assert kv.nbytes == 10 * per_block
    kv.k_caches[1][3, 2].fill_(1.0)  # layers and K/V never alias
    assert kv.k_caches[0].count_nonzero() == 0 and kv.v_caches[1].count_nonzero() == 0
