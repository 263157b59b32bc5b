"""GGUF (llama.cpp) block formats decoded into QuantizedLinear's (q, scale, offset) form, without dequantizing.

Q4_0: blocks of 32: fp16 d, 16 bytes of nibbles (elements 0-15 low nibbles, 16-31 high); w = d * (q - 8).
Q4_1: blocks of 32: fp16 d, fp16 m, 16 bytes as Q4_0; w = d * q + m.
Q8_0: blocks of 32: fp16 d, 32 int8; w = d * q.
Q4_K: super-blocks of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of nibbles in
four 64-element chunks (32 low nibbles, then 32 high); sub-block j (32 elements): w = d * sc_j * q - dmin * m_j.
Every row of a tensor is a whole number of blocks. A row of `in` elements gives (q [in], scale, offset [in / 32]).
"""

from __future__ import annotations

import numpy as np
import torch

from loraledger.errors import QuantizationError

# type name -> (elements per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144)}


def _blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> np.ndarray:
    per, size = BLOCKS[kind]
    if cols % per:
        raise QuantizationError(f"a {kind} row of {cols} elements is not a whole number of {per}-element blocks")
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if data.size != rows * cols // per * size:
        raise QuantizationError(
            f"{kind} tensor holds {data.size} bytes, [{rows}, {cols}] needs {rows * cols // per * size}"
        )
    return data.reshape(rows, cols // per, size)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of each Q4_K super-block from its 12 scale bytes."""
    s = s.astype(np.int32)
    sc = np.empty(s.shape[:-1] + (8,), np.int32)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def decode(raw: np.ndarray, kind: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q unsigned [rows, cols], scale [rows, groups], offset [rows, groups], bits) with W = q * scale + offset."""
    if kind not in BLOCKS:
        raise QuantizationError(f"GGUF tensor type {kind} is not supported (only {', '.join(BLOCKS)})")
    b = _blocks(raw, kind, rows, cols)
    if kind == "Q4_0":
        d = _f16(b[..., 0:2])
        q, scale, offset, bits = _nibbles(b[..., 2:]), d, -8.0 * d, 4
    elif kind == "Q4_1":
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q, scale, offset, bits = _nibbles(b[..., 4:]), d, m, 4
    elif kind == "Q8_0":
        d = _f16(b[..., 0:2])
        q, scale, offset, bits = b[..., 2:].view(np.int8).astype(np.int32) + 128, d, -128.0 * d, 8
    else:
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k4_scales(b[..., 4:16])
        qs = b[..., 16:].reshape(rows, -1, 4, 32)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1, 8, 32)  # sub-blocks 2c, 2c+1 per chunk
        scale = (d[..., None] * sc).reshape(rows, -1)
        offset = (-dmin[..., None] * mn).reshape(rows, -1)
        q, bits = q.reshape(rows, -1, 32), 4
    q = torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols).astype(np.int32))
    scale = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, -1))
    offset = torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(rows, -1))
    return q, scale, offset, bits
