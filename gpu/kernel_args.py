"""The scalar arguments of a kernel launch: device pointers and sized integers, as the kernels' signatures take them."""

from __future__ import annotations

import numpy as np
import torch

GRID_STRIDE_BLOCKS = 65535  # grid-stride kernels never need more blocks than this


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address (0 for None, which a kernel reads as "absent")."""
    return np.uint64(0 if t is None else t.data_ptr())


def i32(v: int) -> np.int32:
    return np.int32(v)


def i64(v: int) -> np.int64:
    return np.int64(v)
