"""Host-to-device copies that do not wait for the device: a step's small index tensors, uploaded while the last step runs.

A plain `tensor.to("cuda")` from pageable host memory synchronises the stream, so every upload in
a step would wait for every kernel queued before it: with overlapped steps, for the whole
previous step. From pinned memory with non_blocking=True the copy is queued like a kernel
(torch's pinned-memory cache keeps the host buffer until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: np.ndarray | Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a `dtype` tensor on `device`, queued behind the work already on its stream (no host wait)."""
    host = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else torch.tensor(values)
    host = host.to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
