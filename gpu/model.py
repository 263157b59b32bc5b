"""Model: our Llama / Mistral / Qwen2 decoder forward over a paged KV cache, with batched multi-LoRA.

Device-agnostic: the attention, norm, rotary and LoRA ops go through the `Ops` backend; GEMMs and
the embedding are plain torch. No transformers model class is used at run time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraledger.gpu.config import ModelConfig
from loraledger.gpu.forward_batch import ForwardBatch
from loraledger.gpu.kv_cache import KVCache
from loraledger.gpu.lora_slots import LoraSlots
from loraledger.gpu.ops import Ops
from loraledger.gpu.rotary import build_cos_sin_cache
from loraledger.gpu.weights import LayerWeights, ModelWeights


class Model:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        ops: Ops,
        *,
        lora_slots: LoraSlots | None = None,
        max_positions: int | None = None,
    ) -> None:
        self.config = config
        self.weights = weights
        self.ops = ops
        self.lora_slots = lora_slots
        device = weights.embed.device
        self.cos_sin_cache = build_cos_sin_cache(config, max_positions or config.max_position_embeddings, device)
        self.scale = config.head_dim**-0.5
        self._split = (config.q_size, config.kv_size, config.kv_size)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run every token of the step; return fp32 logits [N, V] at batch.logits_indices only."""
        cfg, w, ops = self.config, self.weights, self.ops
        hidden = F.embedding(batch.input_ids, w.embed)
        residual: torch.Tensor | None = None
        for i, lw in enumerate(w.layers):
            x, residual = ops.rms_norm(hidden, lw.input_norm, cfg.rms_norm_eps, residual)
            attn = self._attention(i, lw, x, batch, kv_cache)
            x, residual = ops.rms_norm(attn, lw.post_norm, cfg.rms_norm_eps, residual)
            hidden = self._mlp(i, lw, x, batch)
        rows = batch.logits_indices
        if rows.shape[0] == 0:
            return hidden.new_zeros((0, cfg.vocab_size), dtype=torch.float32)
        # the final norm and lm_head only run where logits are wanted
        out, _ = ops.rms_norm(hidden.index_select(0, rows), w.norm, cfg.rms_norm_eps, residual.index_select(0, rows))
        return F.linear(out, w.lm_head).float()

    def _attention(
        self, layer: int, lw: LayerWeights, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> torch.Tensor:
        cfg, ops = self.config, self.ops
        tokens = x.shape[0]
        qkv = F.linear(x, lw.qkv, lw.qkv_bias)
        self._lora(layer, "qkv", x, qkv, batch)
        # q/k/v are row-strided views of the fused output (last two dims contiguous)
        q, k, v = qkv.split(self._split, dim=-1)
        q = q.view(tokens, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(tokens, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(tokens, cfg.num_key_value_heads, cfg.head_dim)
        ops.rotary_embedding(batch.positions, q, k, self.cos_sin_cache)
        k_cache, v_cache = kv_cache.k_caches[layer], kv_cache.v_caches[layer]
        ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        n_dec = batch.num_decode
        window = cfg.sliding_window
        decode_out = prefill_out = None
        if n_dec:
            decode_out = ops.paged_attention_decode(
                q[:n_dec], k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens, self.scale, window
            )
        if n_dec < tokens:
            prefill_out = ops.prefill_attention(
                q[n_dec:],
                k_cache,
                v_cache,
                batch.prefill_query_start_loc,
                batch.prefill_seq_lens,
                batch.prefill_block_tables,
                self.scale,
                window,
            )
        if prefill_out is None:
            attn = decode_out
        elif decode_out is None:
            attn = prefill_out
        else:
            attn = torch.cat((decode_out, prefill_out), dim=0)
        attn = attn.reshape(tokens, cfg.q_size)
        out = F.linear(attn, lw.o)
        self._lora(layer, "o", attn, out, batch)
        return out

    def _mlp(self, layer: int, lw: LayerWeights, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        gate_up = F.linear(x, lw.gate_up)
        self._lora(layer, "gate_up", x, gate_up, batch)
        act = self.ops.silu_and_mul(gate_up)
        out = F.linear(act, lw.down)
        self._lora(layer, "down", act, out, batch)
        return out

    def _lora(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, batch: ForwardBatch) -> None:
        """y += LoRA delta of every adapter token; skipped when no active slot targets this module."""
        if batch.lora is None or group not in batch.lora_groups:
            return
        a, b, offsets = self.lora_slots.layer(layer, group)
        h = self.ops.lora_shrink(x, a, batch.lora)
        self.ops.lora_expand(h, b, batch.lora, offsets, y)
