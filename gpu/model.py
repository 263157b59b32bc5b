"""Model: our Llama / Mistral / Qwen2 / Qwen3 / Gemma 2-3 decoder forward over a paged KV cache, with batched multi-LoRA.

Device-agnostic: the attention, norm, rotary and LoRA ops go through the `Ops` backend; the base
GEMMs go through `Dense` (F.linear, or oneDNN pre-packed weights on the CPU); the embedding is plain
torch. No transformers model class is used at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import torch
import torch.nn.functional as F

from loraledger.gpu.dense import Dense, prepack_supported
from loraledger.gpu.forward_batch import ForwardBatch
from loraledger.gpu.kv_cache import KVCache
from loraledger.gpu.model_config import ModelConfig
from loraledger.gpu.ops import Ops
from loraledger.gpu.quant_projection import DeviceQuantProjection
from loraledger.gpu.rotary import build_cos_sin_cache
from loraledger.gpu.weights import ModelWeights
from loraledger.lora.device_slots import LoraSlots
from loraledger.quantization.affine import AffineWeight
from loraledger.quantization.projection import QuantizedProjection
from loraledger.quantization.quantized_embedding import QuantizedEmbedding


@dataclass
class DecoderLayer:
    """One decoder layer as the forward runs it: the two norm weights and the four fused projections."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Dense | QuantizedProjection | DeviceQuantProjection
    o: Dense | QuantizedProjection | DeviceQuantProjection
    gate_up: Dense | QuantizedProjection | DeviceQuantProjection
    down: Dense | QuantizedProjection | DeviceQuantProjection
    q_norm: torch.Tensor | None = None  # per-head RMSNorm weights of q and k (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    pre_ff_norm: torch.Tensor | None = None  # Gemma 2/3: the MLP's own norms before and after it
    post_ff_norm: torch.Tensor | None = None


class Model:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        ops: Ops,
        *,
        lora_slots: LoraSlots | None = None,
        max_positions: int | None = None,
        prepack: bool | None = None,
    ) -> None:
        """`prepack`: give the projections oneDNN pre-packed weights (None: wherever prepack_supported()).

        The Model keeps only what its forward reads (pre-packed copies replace the plain projection
        weights), so a caller that drops `weights` afterwards does not hold the base weights twice.
        """
        self.config = config
        self.ops = ops
        self.lora_slots = lora_slots
        device = weights.embed.device
        if prepack is None:
            prepack = prepack_supported(device, weights.lm_head.dtype)
        self.embed = weights.embed
        self.dtype = weights.lm_head.dtype  # the activations' dtype
        self.norm = weights.norm
        # a quantized lm_head (a GGUF file's, often the tied embedding) runs from its packed bytes
        lm_head = weights.lm_head
        self.lm_head = lm_head if isinstance(lm_head, QuantizedEmbedding) else Dense(lm_head, prepack=prepack)
        dtype = weights.embed.dtype

        def projection(weight, bias=None):
            """Dense for a float weight; a quantized one (a list of its parts) stays packed: for torch's CPU kernels
            (parts as read) or for CudaOps.quant_linear (parts in the device layout)."""
            if isinstance(weight, torch.Tensor):
                return Dense(weight, bias, prepack=prepack)
            if isinstance(weight[0], AffineWeight):
                return QuantizedProjection(weight, bias, dtype=dtype)
            return DeviceQuantProjection(weight, bias, ops)

        self.layers = [
            DecoderLayer(
                input_norm=lw.input_norm,
                post_norm=lw.post_norm,
                qkv=projection(lw.qkv, lw.qkv_bias),
                o=projection(lw.o),
                gate_up=projection(lw.gate_up),
                down=projection(lw.down),
                q_norm=lw.q_norm,
                k_norm=lw.k_norm,
                pre_ff_norm=lw.pre_ff_norm,
                post_ff_norm=lw.post_ff_norm,
            )
            for lw in weights.layers
        ]
        positions = max_positions or config.max_position_embeddings
        self.cos_sin_cache = build_cos_sin_cache(config, positions, device)
        # Gemma 3's sliding-window layers turn q and k with a rope base of their own, unscaled
        self.local_cos_sin_cache = (
            build_cos_sin_cache(
                msgspec.structs.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None),
                positions,
                device,
            )
            if config.local_rope_theta is not None
            else self.cos_sin_cache
        )
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        # Gemma scales the embedding by sqrt(hidden), rounded to the activations' dtype as transformers does
        self.embed_scale = (
            torch.tensor(math.sqrt(config.hidden_size), dtype=weights.lm_head.dtype).item()
            if config.scale_embedding
            else None
        )
        self._split = (config.q_size, config.kv_size, config.kv_size)

    def resident_weight_bytes(self) -> int:
        """Bytes the base weights hold as the forward reads them (packed quantized layers at their packed size)."""
        seen: dict[int, int] = {}
        for t in (self.norm, *(t for lw in self.layers for t in (lw.input_norm, lw.post_norm))):
            seen[t.data_ptr()] = t.nbytes
        if isinstance(self.embed, QuantizedEmbedding):
            seen[id(self.embed)] = self.embed.resident_bytes()
        else:
            seen[self.embed.data_ptr()] = self.embed.nbytes
        if self.lm_head is not self.embed:  # a tied quantized lm_head is the embedding's own bytes
            seen[id(self.lm_head)] = self.lm_head.resident_bytes()
        total = sum(seen.values())
        for proj in (p for lw in self.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)):
            total += proj.resident_bytes()
        return total

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run every token of the step; return fp32 logits [N, V] at batch.logits_indices only."""
        cfg, ops = self.config, self.ops
        if isinstance(self.embed, QuantizedEmbedding):  # only this step's rows are dequantized
            hidden = self.embed.lookup(batch.input_ids)
        else:
            hidden = F.embedding(batch.input_ids, self.embed).to(self.dtype)  # on the CPU the checkpoint's own dtype
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        residual: torch.Tensor | None = None
        eps = cfg.rms_norm_eps
        for i, lw in enumerate(self.layers):
            x, residual = ops.rms_norm(hidden, lw.input_norm, eps, residual)
            attn = self._attention(i, lw, x, batch, kv_cache)
            if lw.pre_ff_norm is None:
                x, residual = ops.rms_norm(attn, lw.post_norm, eps, residual)
                hidden = self._mlp(i, lw, x, batch)
            else:  # Gemma: each sublayer's output is normalised before it joins the residual stream
                x, residual = ops.rms_norm(ops.rms_norm(attn, lw.post_norm, eps)[0], lw.pre_ff_norm, eps, residual)
                hidden = ops.rms_norm(self._mlp(i, lw, x, batch), lw.post_ff_norm, eps)[0]
        rows = batch.logits_indices
        if rows.shape[0] == 0:
            return hidden.new_zeros((0, cfg.vocab_size), dtype=torch.float32)
        # the final norm and lm_head only run where logits are wanted
        out, _ = ops.rms_norm(hidden.index_select(0, rows), self.norm, eps, residual.index_select(0, rows))
        logits = self.lm_head(out).float()
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def _attention(
        self, layer: int, lw: DecoderLayer, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> torch.Tensor:
        cfg, ops = self.config, self.ops
        tokens = x.shape[0]
        qkv = lw.qkv(x)
        self._lora(layer, "qkv", x, qkv, batch)
        # q/k/v are row-strided views of the fused output (last two dims contiguous)
        q, k, v = qkv.split(self._split, dim=-1)
        q = q.view(tokens, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(tokens, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(tokens, cfg.num_key_value_heads, cfg.head_dim)
        if lw.q_norm is not None:  # each head normalised on its own, before rotary
            q = ops.rms_norm(q.reshape(-1, cfg.head_dim), lw.q_norm, cfg.rms_norm_eps)[0].view(q.shape)
            k = ops.rms_norm(k.reshape(-1, cfg.head_dim), lw.k_norm, cfg.rms_norm_eps)[0].view(k.shape)
        window = cfg.window(layer)
        ops.rotary_embedding(batch.positions, q, k, self.cos_sin_cache if window is None else self.local_cos_sin_cache)
        k_cache, v_cache = kv_cache.k_caches[layer], kv_cache.v_caches[layer]
        ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        n_dec = batch.num_decode
        capped = {} if cfg.attn_softcap is None else {"softcap": cfg.attn_softcap}
        decode_out = prefill_out = None
        if n_dec:
            decode_out = ops.paged_attention_decode(
                q[:n_dec],
                k_cache,
                v_cache,
                batch.decode_block_tables,
                batch.decode_seq_lens,
                self.scale,
                window,
                **capped,
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
                batch.prefill_sizes,
                **capped,
            )
        if prefill_out is None:
            attn = decode_out
        elif decode_out is None:
            attn = prefill_out
        else:
            attn = torch.cat((decode_out, prefill_out), dim=0)
        attn = attn.reshape(tokens, cfg.q_size)
        out = lw.o(attn)
        self._lora(layer, "o", attn, out, batch)
        return out

    def _mlp(self, layer: int, lw: DecoderLayer, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        gate_up = lw.gate_up(x)
        self._lora(layer, "gate_up", x, gate_up, batch)
        if self.config.hidden_act == "silu":
            act = self.ops.silu_and_mul(gate_up)
        else:  # gelu_pytorch_tanh (Gemma)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        out = lw.down(act)
        self._lora(layer, "down", act, out, batch)
        return out

    def _lora(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, batch: ForwardBatch) -> None:
        """y += LoRA delta of every adapter token; skipped when no active slot targets this module."""
        if batch.lora is None or group not in batch.lora_groups:
            return
        a, b, offsets = self.lora_slots.layer(layer, group)
        self.ops.lora_apply(x, a, b, batch.lora, offsets, y)
