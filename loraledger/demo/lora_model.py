"""A Llama decoder in plain torch with trainable LoRA factors on its top layers: what the demo's trainer runs.

The base weights are frozen and the lower layers carry no LoRA, so their output for a training line never
changes: the trainer computes it once, without autograd, and every step runs only the top layers (forward and
backward). `run` takes the key/value states of earlier positions, so a prefix every line shares (the chat
template's system turn) runs once, not once per line. The LoRA delta is PEFT's: y = x W^T + (alpha / r) * (x A^T) B^T, A initialised as PEFT's
kaiming-uniform and B as zeros, so step 0 is the base model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraledger.errors import ConfigError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
KV = tuple[torch.Tensor, torch.Tensor]  # one layer's key and value states [B, kv_heads, T, head_dim], rotated


@dataclass(frozen=True)
class LlamaShape:
    """What the forward pass needs of config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float

    @classmethod
    def from_config(cls, config: Mapping) -> LlamaShape:
        heads = int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"the demo's trainer runs default rotary embeddings only, not {rope['rope_type']!r}")
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            rope_theta=float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        )


class LoraLlama(torch.nn.Module):
    """weights: the checkpoint's tensors by Hugging Face name (model.layers.N.self_attn.q_proj.weight, ...)."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        shape: LlamaShape,
        *,
        first_lora_layer: int,
        targets: Sequence[str],
        rank: int,
        alpha: float,
        seed: int,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.w = {k: v.float() for k, v in weights.items()}  # frozen: plain tensors, not parameters
        if not 0 <= first_lora_layer < shape.num_layers:
            raise ConfigError(f"first_lora_layer must be in [0, {shape.num_layers}), got {first_lora_layer}")
        self.first_lora_layer = first_lora_layer
        self.lora_layers = list(range(first_lora_layer, shape.num_layers))
        self.targets = tuple(targets)
        self.scale = alpha / rank
        gen = torch.Generator().manual_seed(seed)
        self.lora = torch.nn.ParameterDict()
        for layer in self.lora_layers:
            for module in self.targets:
                out_f, in_f = self.w[self.weight_name(layer, module)].shape
                # PEFT's init: kaiming_uniform_(a=sqrt(5)) on A, i.e. uniform(+-1/sqrt(in_features)); B zeros
                bound = 1 / math.sqrt(in_f)
                a = (torch.rand(rank, in_f, generator=gen) * 2 - 1) * bound
                self.lora[self.key(layer, module, "A")] = torch.nn.Parameter(a)
                self.lora[self.key(layer, module, "B")] = torch.nn.Parameter(torch.zeros(out_f, rank))
        half = shape.head_dim // 2
        self.inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, half, dtype=torch.float32) * 2 / shape.head_dim))
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    @staticmethod
    def weight_name(layer: int, module: str) -> str:
        kind = "self_attn" if module in ATTENTION else "mlp"
        return f"model.layers.{layer}.{kind}.{module}.weight"

    @staticmethod
    def key(layer: int, module: str, factor: str) -> str:
        return f"{layer}_{module}_{factor}"

    def peft_state(self) -> dict[str, torch.Tensor]:
        """The LoRA factors under PEFT's saved key names (adapter_model.safetensors)."""
        out = {}
        for layer in self.lora_layers:
            for module in self.targets:
                stem = "base_model.model." + self.weight_name(layer, module).removesuffix(".weight")
                out[f"{stem}.lora_A.weight"] = self.lora[self.key(layer, module, "A")].detach().clone().contiguous()
                out[f"{stem}.lora_B.weight"] = self.lora[self.key(layer, module, "B")].detach().clone().contiguous()
        return out

    # -- forward ---------------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.w["model.embed_tokens.weight"][token_ids]

    def run(
        self, h: torch.Tensor, layers: range, start: int = 0, past: Sequence[KV] | None = None
    ) -> tuple[torch.Tensor, list[KV]]:
        """Hidden states [B, T, H] at positions start.. through `layers`; with `past` (the key/value states of
        positions 0..start-1, one per layer, batch 1 or B) every position also attends to those. Returns the
        hidden states and each layer's key/value states of these positions. Right-padded batches are fine:
        causal attention never looks at the padding after a position."""
        cos, sin = self.rotary(start, start + h.shape[1])
        kvs = []
        for i, layer in enumerate(layers):
            h, kv = self.block(h, layer, cos, sin, None if past is None else past[i])
            kvs.append(kv)
        return h, kvs

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> logits [B, T, V]."""
        h, _ = self.run(self.embed(token_ids), range(self.shape.num_layers))
        return self.logits(self.final_norm(h))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(h, self.w["model.norm.weight"])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.T

    def rotary(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(start, stop, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + self.shape.rms_norm_eps))

    def linear(self, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        y = x @ self.w[self.weight_name(layer, module)].T
        if layer >= self.first_lora_layer and module in self.targets:
            a, b = self.lora[self.key(layer, module, "A")], self.lora[self.key(layer, module, "B")]
            y = y + (x @ a.T) @ b.T * self.scale
        return y

    def block(
        self, h: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor, past: KV | None
    ) -> tuple[torch.Tensor, KV]:
        s = self.shape
        p = f"model.layers.{layer}."
        x = self.rms_norm(h, self.w[p + "input_layernorm.weight"])
        batch, length, _ = x.shape
        q = self.linear(x, layer, "q_proj").view(batch, length, s.num_heads, s.head_dim).transpose(1, 2)
        k = self.linear(x, layer, "k_proj").view(batch, length, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.linear(x, layer, "v_proj").view(batch, length, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        own = (k, v)
        mask = None
        if past is not None:
            past_k, past_v = (t.expand(batch, -1, -1, -1) for t in past)
            k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            mask = torch.cat((torch.ones(length, past_k.shape[2], dtype=torch.bool), causal), dim=1)
        groups = s.num_heads // s.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        h = h + self.linear(attn.transpose(1, 2).reshape(batch, length, -1), layer, "o_proj")
        x = self.rms_norm(h, self.w[p + "post_attention_layernorm.weight"])
        mlp = F.silu(self.linear(x, layer, "gate_proj")) * self.linear(x, layer, "up_proj")
        return h + self.linear(mlp, layer, "down_proj"), own


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
