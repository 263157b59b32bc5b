"""The marks every CPU-kernel test module carries (`pytestmark = CPU_KERNEL_TESTS`): skipped without a C compiler to
build the kernel, and every kernel looked up anew around each test (the `fresh_cpu_kernels` fixture of
tests/gpu/conftest.py), so that none is cached from an earlier test."""

from __future__ import annotations

import shutil

import pytest

CPU_KERNEL_TESTS = [
    pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc) to build the kernel"),
    pytest.mark.usefixtures("fresh_cpu_kernels"),
]
