"""Kernel launchers: the KernelLauncher protocol CudaOps launches through, and CupyLauncher, its GPU implementation."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from loraledger.errors import KernelInputError
from loraledger.gpu import kernel_sources as ks

_MAX_GRID_X = 2**31 - 1
_MAX_GRID_YZ = 65535
_MAX_STATIC_SMEM = 48 * 1024  # dynamic shared memory above this needs an opt-in attribute


class KernelLauncher(Protocol):
    """Runs one kernel instantiation: CuPy on a GPU by default; the tests plug in a CPU emulation."""

    sm_count: int
    compute_capability: tuple[int, int]  # kernels with thread block clusters need (9, 0) or newer

    def launch(
        self,
        template: ks.KernelTemplate,
        targs: tuple[object, ...],
        grid: tuple[int, ...],
        block: int,
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None: ...


class CupyLauncher:
    """Compiles each instantiation on first use (CuPy also caches it on disk); launches on torch's current stream."""

    def __init__(self, device: torch.device) -> None:
        import cupy

        self._cupy = cupy
        self._torch_device = device
        self._device = cupy.cuda.Device(device.index)
        self._functions: dict[str, Any] = {}
        self._streams: dict[int, Any] = {}
        props = torch.cuda.get_device_properties(device)
        self.sm_count = props.multi_processor_count
        self.compute_capability = (props.major, props.minor)

    def _function(self, template: ks.KernelTemplate, targs: tuple[object, ...]) -> Any:
        expr = template.expression(*targs)
        fn = self._functions.get(expr)
        if fn is None:
            with self._device:
                module = self._cupy.RawModule(
                    code=ks.load_source(template.source), options=ks.COMPILE_OPTIONS, name_expressions=(expr,)
                )
                fn = module.get_function(expr)
            self._functions[expr] = fn
        return fn

    def _stream(self) -> Any:
        ptr = torch.cuda.current_stream(self._torch_device).cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._cupy.cuda.ExternalStream(ptr, self._torch_device.index)
            self._streams[ptr] = stream
        return stream

    def launch(
        self,
        template: ks.KernelTemplate,
        targs: tuple[object, ...],
        grid: tuple[int, ...],
        block: int,
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None:
        if shared_mem > _MAX_STATIC_SMEM:
            raise KernelInputError(
                f"{template.name}: needs {shared_mem} bytes of shared memory, above the {_MAX_STATIC_SMEM} a "
                "launch gets without opt-in; use a smaller head_dim / rank"
            )
        if grid[0] > _MAX_GRID_X or any(g > _MAX_GRID_YZ for g in grid[1:]):
            raise KernelInputError(f"{template.name}: grid {grid} exceeds CUDA's limits; split the batch")
        if template.cluster > 1 and (self.compute_capability < (9, 0) or grid[0] % template.cluster):
            raise KernelInputError(
                f"{template.name} runs in clusters of {template.cluster} blocks: it needs compute capability 9.0 "
                f"(this GPU has {self.compute_capability}) and a grid.x that is a multiple of {template.cluster}, got {grid}"
            )
        fn = self._function(template, targs)
        with self._device, self._stream():
            fn(grid, (block,), args, shared_mem=shared_mem)
