"""The marks of a test that needs a CUDA GPU: the `gpu` marker, and a skip with its reason printed where none can run."""

from __future__ import annotations

import pytest

from loraledger.gpu.backend import cuda_problem

GPU_PROBLEM = cuda_problem()
requires_gpu = pytest.mark.skipif(GPU_PROBLEM is not None, reason=f"needs a CUDA GPU and CuPy: {GPU_PROBLEM}")
ON_GPU = [pytest.mark.gpu, requires_gpu]
