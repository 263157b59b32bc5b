"""Rotary position embedding tables: the [max_pos, head_dim] cos/sin cache, with Llama-3 and linear scaling."""

from __future__ import annotations

import math

import torch

from loraledger.errors import ModelLoadError
from loraledger.gpu.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The per-pair rotation frequencies [head_dim / 2] (fp32), after the config's rope scaling.

    Computed exactly as transformers does, so that the fp32 tables match bit for bit.
    """
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ModelLoadError(
        f"rope scaling {rope_type!r} is not supported (supported: default, linear, llama3); "
        "use a model whose config.json has one of these rope types"
    )


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    try:
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
    except KeyError as exc:
        raise ModelLoadError(f"llama3 rope scaling is missing {exc.args[0]!r} in config.json") from exc
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are stretched by the full factor, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(config: ModelConfig, max_positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_positions, head_dim] fp32: the first head_dim/2 columns cos, the last head_dim/2 sin."""
    inv_freq = inverse_frequencies(config)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous().to(device)
