"""ModelConfig: the base model's shape, read from a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3/4)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from loraledger.errors import ModelLoadError, RemoteCodeError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
_MODEL_TYPES = {"gemma3_text": "gemma3"}  # config.json model_type -> our name, where they differ
_GEMMA = ("gemma2", "gemma3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation (hidden_act / hidden_activation)

# LoRA targets we can apply, in the order the fused modules hold them
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3" | "phi3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v carry a bias (Qwen2 always)
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # as saved, e.g. "bfloat16"
    # per layer, the attention window (None: full attention), as transformers' layer_types give it: Mistral's
    # window on every layer; Qwen2's (use_sliding_window) only on layers >= max_window_layers
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before rotary (Qwen3, Gemma 3)
    # Gemma 2/3: RMSNorm weights stored as w for (1 + w), the embedding scaled by sqrt(hidden), norms around
    # both the attention and the MLP output, tanh soft-capping of attention scores and of the final logits
    norm_offset: float = 0.0
    scale_embedding: bool = False
    sandwich_norms: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default: head_dim)
    hidden_act: str = "silu"
    local_rope_theta: float | None = None  # Gemma 3: the rope base of sliding-window layers
    fused_projections: bool = False  # Phi-3: the checkpoint holds qkv_proj and gate_up_proj already fused

    def window(self, layer: int) -> int | None:
        """The attention window of one layer (None: the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def check_device(self, device_type: str) -> None:
        """Refuse what the device's backend does not run: soft-capped attention scores (Gemma 2) on CUDA."""
        if device_type == "cuda" and self.attn_softcap is not None:
            raise ModelLoadError(
                f"{self.architecture}: attention score soft-capping (attn_logit_softcapping={self.attn_softcap}) is "
                "not implemented by the CUDA kernels yet; run this model with device='cpu'"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable linear layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} not found: the model folder must hold a Hugging Face config.json")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = _MODEL_TYPES.get(raw.get("model_type"), raw.get("model_type"))
            arch = model_type if model_type in SUPPORTED_ARCHITECTURES.values() else None
        if arch is None and raw.get("auto_map"):
            raise RemoteCodeError(
                f"{source}: architecture {archs or raw.get('model_type')!r} comes with its own model code (config.json "
                f"'auto_map': {sorted(raw['auto_map'])}), and loraledger never runs code shipped with a checkpoint, "
                f"trust_remote_code or not; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch is None:
            raise ModelLoadError(
                f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if kv_heads < 1 or heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads}); "
                "each key/value head serves an equal group of query heads"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = raw.get("rope_scaling") or None
        rope_theta = raw.get("rope_theta")
        local_rope_theta = raw.get("rope_local_base_freq") if arch == "gemma3" else None
        if rope_theta is None and isinstance(raw.get("rope_parameters"), dict):
            # transformers >= 5 writes rope settings under rope_parameters, per layer type where they differ
            params = raw["rope_parameters"]
            if isinstance(params.get("full_attention"), dict):
                local = params.get("sliding_attention") or {}
                if local.get("rope_type", "default") != "default":
                    raise ModelLoadError(f"{source}: rope scaling on sliding-window layers is not supported")
                local_rope_theta = local.get("rope_theta")
                params = params["full_attention"]
            rope_theta = params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = dict(params)
        sliding = raw.get("sliding_window")
        if arch in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
            sliding = None
        sliding = int(sliding) if sliding else None
        layers = int(raw["num_hidden_layers"])
        rope_params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
        partial = float(raw.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0)
        if partial != 1.0:
            raise ModelLoadError(
                f"{source}: partial_rotary_factor {partial} (rotary on part of each head, as in Phi-4-mini) is not "
                "supported; supported: rotary over the whole head"
            )
        layer_windows = _layer_windows(raw, arch, layers, sliding, source)
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            sliding_window=sliding,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            layer_windows=layer_windows,
            qk_norm=arch in ("qwen3", "gemma3"),
            fused_projections=arch == "phi3",
            **_gemma_fields(raw, arch, local_rope_theta, source),
        )


def _gemma_fields(raw: dict, arch: str, local_rope_theta: float | None, source: str) -> dict:
    """What Gemma 2/3 change in the decoder (empty for the other families, which must use SiLU)."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in ACTIVATIONS or (act != "silu" and arch not in _GEMMA):
        raise ModelLoadError(f"{source}: MLP activation {act!r} is not supported for {arch}; supported: silu")
    if arch not in _GEMMA:
        return {}
    scalar = raw.get("query_pre_attn_scalar")
    return dict(
        norm_offset=1.0,
        scale_embedding=True,
        sandwich_norms=True,
        attn_softcap=float(raw["attn_logit_softcapping"]) if raw.get("attn_logit_softcapping") else None,
        final_softcap=float(raw["final_logit_softcapping"]) if raw.get("final_logit_softcapping") else None,
        query_pre_attn_scalar=float(scalar) if scalar else None,
        hidden_act=act,
        local_rope_theta=float(local_rope_theta) if local_rope_theta else (10000.0 if arch == "gemma3" else None),
    )


def _layer_windows(raw: dict, arch: str, layers: int, sliding: int | None, source: str) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers decides it: `layer_types` when the config lists them
    ("sliding_attention" layers get the window), else Qwen2's rule (layers at or above max_window_layers,
    with use_sliding_window) or, for the others, the window on every layer."""
    types = raw.get("layer_types")
    if types is not None:
        if (
            not isinstance(types, list)
            or len(types) != layers
            or not set(types) <= {"full_attention", "sliding_attention"}
        ):
            raise ModelLoadError(
                f"{source}: layer_types must list 'full_attention' or 'sliding_attention' for each of the {layers} layers"
            )
        return tuple(sliding if t == "sliding_attention" else None for t in types)
    if sliding is None:
        return (None,) * layers
    if arch in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", 28))  # transformers' Qwen2Config default
        return tuple(sliding if i >= first else None for i in range(layers))
    if arch == "gemma2":  # older config.json files: every other layer, from the first, has the window
        return tuple(sliding if i % 2 == 0 else None for i in range(layers))
    if arch == "gemma3":  # every sliding_window_pattern-th layer attends globally
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple(None if (i + 1) % pattern == 0 else sliding for i in range(layers))
    return (sliding,) * layers
