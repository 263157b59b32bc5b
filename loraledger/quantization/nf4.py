"""NF4 (QLoRA's 4-bit normal float, bitsandbytes' nf4): quantizing a float weight at load as bitsandbytes does it
(`quantization="bitsandbytes"` on a float checkpoint), blockwise with one absmax per block of 64 elements, each
element rounded to the nearest of 16 fixed levels in [-1, 1]."""

from __future__ import annotations

import torch

# the 16 NF4 levels as bitsandbytes defines them
LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])  # fmt: skip
BLOCKSIZE = 64


def quantize(w: torch.Tensor, blocksize: int = BLOCKSIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int64 [numel], absmax fp32 [numel / blocksize]) of w; numel must be a multiple of blocksize."""
    flat = w.to(torch.float32).reshape(-1, blocksize)
    absmax = flat.abs().amax(1)
    scaled = flat / absmax.clamp(min=1e-30)[:, None]
    # the nearest level: midpoints between neighbours split the range
    codes = torch.bucketize(scaled, (LEVELS[1:] + LEVELS[:-1]) / 2)
    return codes.reshape(-1), absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...], blocksize: int = BLOCKSIZE):
    """The fp32 weight the codes stand for."""
    return (LEVELS[codes].reshape(-1, blocksize) * absmax[:, None]).reshape(shape)


def round_trip(w: torch.Tensor) -> torch.Tensor:
    """w quantized to NF4 and back (fp32): what a layer quantized at load computes with."""
    codes, absmax = quantize(w)
    return dequantize(codes, absmax, tuple(w.shape))
