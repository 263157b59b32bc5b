"""Tests for gpu/backend.py: cpu selection, "cuda" refused with the fix where it cannot run, "auto" falling back."""

from __future__ import annotations

import sys

import pytest
import torch

from loraledger.errors import DeviceError
from loraledger.gpu import backend
from loraledger.gpu.backend import NO_CUPY_MESSAGE, NO_GPU_MESSAGE, cuda_problem, select_backend
from loraledger.gpu.ops_cuda import CudaOps
from loraledger.gpu.ops_torch import TorchOps


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpu_without_cupy(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError


def test_cpu_selects_torch_ops():
    ops, device = select_backend("cpu")
    assert isinstance(ops, TorchOps)
    assert device == torch.device("cpu")


def test_cuda_without_a_gpu_names_the_fix(no_gpu):
    assert cuda_problem() == NO_GPU_MESSAGE
    with pytest.raises(DeviceError) as err:
        select_backend("cuda")
    assert str(err.value) == (
        "no CUDA GPU is visible to torch; use device='cpu' or run on a machine with an NVIDIA GPU "
        "and a CUDA build of torch"
    )
    with pytest.raises(DeviceError, match="no CUDA GPU is visible to torch"):
        select_backend("cuda:1")
    with pytest.raises(DeviceError, match="no CUDA GPU is visible to torch"):
        CudaOps("cuda")


def test_cuda_without_cupy_names_the_pip_extra(gpu_without_cupy):
    with pytest.raises(DeviceError, match=r"pip install 'loraledger\[cuda\]'") as err:
        select_backend("cuda")
    assert str(err.value).startswith(NO_CUPY_MESSAGE)


class _RecordingLogger:
    def __init__(self) -> None:
        self.lines: list[dict] = []

    def info(self, event: str, **fields) -> None:
        self.lines.append({"event": event, **fields})


@pytest.mark.parametrize("problem", ["no_gpu", "gpu_without_cupy"])
def test_auto_falls_back_to_cpu_and_logs_why(problem, request, monkeypatch):
    request.getfixturevalue(problem)
    log = _RecordingLogger()
    monkeypatch.setattr(backend, "get_logger", lambda actor: log)
    ops, device = select_backend("auto")
    assert isinstance(ops, TorchOps) and device == torch.device("cpu")
    assert log.lines == [
        {"event": "backend selected", "backend": "torch", "device": "cpu", "reason": f"auto: {cuda_problem()}"}
    ]


def test_auto_picks_cuda_when_both_are_present(monkeypatch):
    built = []
    monkeypatch.setattr(backend, "cuda_problem", lambda: None)
    monkeypatch.setattr(backend, "require_cuda", lambda: None)
    monkeypatch.setattr(backend, "_cuda_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr("loraledger.gpu.ops_cuda.CudaOps", lambda dev: built.append(dev) or TorchOps())
    _, device = select_backend("auto")
    assert device == torch.device("cuda", 0) and built == [torch.device("cuda", 0)]


def test_unknown_device_is_refused():
    with pytest.raises(DeviceError, match=r"unknown device 'tpu': use 'cpu', 'cuda', 'cuda:N' or 'auto'"):
        select_backend("tpu")
