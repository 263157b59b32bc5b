"""select_backend: choose the device-op backend once at start-up (TorchOps on the CPU, CudaOps on an NVIDIA GPU)."""

from __future__ import annotations

import torch

from loraledger.errors import DeviceError
from loraledger.gpu.ops import Ops
from loraledger.logging import get_logger

NO_GPU_MESSAGE = (
    "no CUDA GPU is visible to torch; use device='cpu' or run on a machine with an NVIDIA GPU and a CUDA build of torch"
)
NO_CUPY_MESSAGE = (
    "CuPy is not installed, and the CUDA kernels need it: pip install 'loraledger[cuda]' (CUDA 12) "
    "or 'loraledger[cuda13]' (CUDA 13)"
)


def cuda_problem() -> str | None:
    """Why the CUDA backend cannot run here (the message names the fix), or None when it can."""
    if not torch.cuda.is_available():
        return NO_GPU_MESSAGE
    try:
        import cupy  # noqa: F401  (imported only to learn whether it can be)
    except ImportError as exc:
        return f"{NO_CUPY_MESSAGE} ({exc})"
    return None


def require_cuda() -> None:
    problem = cuda_problem()
    if problem is not None:
        raise DeviceError(problem)


def _cuda_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise DeviceError(f"invalid device {device!r}: use 'cuda' or 'cuda:N' ({exc})") from exc
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise DeviceError(
            f"device {device!r} does not exist: torch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def select_backend(device: str) -> tuple[Ops, torch.device]:
    """ "cpu" -> TorchOps; "cuda" / "cuda:N" -> CudaOps (DeviceError naming the fix when it cannot run);
    "auto" -> CUDA when a GPU and CuPy are both present, else the CPU (the choice and its reason are logged).
    """
    log = get_logger("backend")
    if device == "cpu":
        from loraledger.gpu.ops_torch import TorchOps

        return TorchOps(), torch.device("cpu")
    if device == "cuda" or device.startswith("cuda:"):
        require_cuda()
        from loraledger.gpu.ops_cuda import CudaOps

        dev = _cuda_device(device)
        return CudaOps(dev), dev
    if device == "auto":
        problem = cuda_problem()
        if problem is None:
            ops, dev = select_backend("cuda")
            reason = "auto: a CUDA GPU and CuPy are present"
            log.info("backend selected", backend=ops.name, device=str(dev), reason=reason)
            return ops, dev
        ops, dev = select_backend("cpu")
        log.info("backend selected", backend=ops.name, device=str(dev), reason=f"auto: {problem}")
        return ops, dev
    raise DeviceError(f"unknown device {device!r}: use 'cpu', 'cuda', 'cuda:N' or 'auto'")
