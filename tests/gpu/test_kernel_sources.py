"""Tests for gpu/kernel_sources.py: every kernel instantiation compiles with nvcc (tests/gpu/nvcc_builds.py), NVRTC-clean."""

from __future__ import annotations

import re

import pytest

from loraledger.errors import KernelInputError
from loraledger.gpu import kernel_sources as ks
from tests.gpu import nvcc_builds


def test_every_instantiation_compiles_with_nvcc_and_the_cubins_hold_exactly_the_listed_kernels():
    """Each source for sm_90 and the arch-dependent one for sm_80 too (every source for every arch: python -m
    tests.gpu.nvcc_builds)."""
    compiler = nvcc_builds.nvcc()
    if compiler is None:
        pytest.skip("nvcc is not installed: the CUDA kernel sources cannot be compiled here")
    jobs = nvcc_builds.suite_builds()
    assert {s for s, _ in jobs} == set(ks.SOURCES) and ("lora.cu", "sm_80") in jobs
    found = [p for build in nvcc_builds.compile_all(compiler, jobs) for p in nvcc_builds.problems(build)]
    assert not found, "\n\n".join(found)


@pytest.mark.parametrize("source", ks.SOURCES)
def test_sources_are_nvrtc_clean(source):
    text = ks.load_source(source)
    # NVRTC ships no host headers (and CuPy wheels not always the fp16/bf16 ones): nothing may be included
    assert not re.search(r"^\s*#\s*include", text, re.MULTILINE), f"{source} still includes a header after inlining"
    assert text.count("LORALEDGER_COMMON_CUH") == 3  # common.cuh pasted exactly once (#ifndef, #define, #endif)
    for host_only in (r"std::", r"\bmalloc\(", r"\bprintf\(", r"(?<!static_)assert\("):
        assert not re.search(host_only, text), f"{source} uses {host_only!r}, which needs a host header under NVRTC"
    for template in ks.KERNELS:
        if template.source == source:
            cluster = r"LORALEDGER_CLUSTER\(\w+\) " if template.cluster > 1 else ""
            assert re.search(rf"__global__ void {cluster}(__launch_bounds__\(\w+\) )?{template.name}\(", text), (
                template.name
            )


def test_kernel_launch_geometry_matches_the_python_constants():
    expected = {
        "lora.cu": {
            "kShrinkThreads": ks.LORA_SHRINK_THREADS,
            "kExpandThreads": ks.LORA_EXPAND_THREADS,
            "kFusedThreads": ks.LORA_FUSED_THREADS,
            "kFusedCluster": ks.LORA_FUSED_CLUSTER,
        },
        "paged_attention.cu": {"kAttnThreads": ks.ATTENTION_THREADS},
    }
    for source, constants in expected.items():
        text = ks.load_source(source)
        for name, value in constants.items():
            found = re.search(rf"constexpr int {name} = (\d+);", text)
            assert found is not None and int(found.group(1)) == value, f"{source}: {name}"


def test_load_source_rejects_unknown_files():
    with pytest.raises(KernelInputError, match="unknown kernel source 'nope.cu'"):
        ks.load_source("nope.cu")


def test_expression_names_only_listed_instantiations():
    expr = ks.LORA_SHRINK.expression("bf16_t", 1, ks.BGMV_SHRINK_ROWS)
    assert expr == f"lora_shrink_kernel<bf16_t, 1, {ks.BGMV_SHRINK_ROWS}>"
    with pytest.raises(KernelInputError, match=r"no instantiation <double>"):
        ks.RMS_NORM.expression("double")
