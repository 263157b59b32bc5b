"""Tests for gpu/kernel_sources.py: every kernel instantiation compiles with nvcc for sm_80 and sm_90, NVRTC-clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from loraledger.errors import KernelInputError
from loraledger.gpu import kernel_sources as ks

ARCHS = ("sm_80", "sm_90")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def _instantiation_unit(source: str) -> tuple[str, tuple[str, ...]]:
    """The source as CuPy compiles it, plus host references that force each name expression to be instantiated."""
    exprs = tuple(e for k in ks.KERNELS if k.source == source for e in k.expressions())
    refs = ",\n    ".join(f"reinterpret_cast<void*>(&{e})" for e in exprs)
    return f"{ks.load_source(source)}\n\nvoid* loraledger_instances[] = {{\n    {refs}\n}};\n", exprs


def _kernel_symbols(cubin: bytes) -> set[str]:
    """Mangled names of the kernels in a cubin: each has its own `.text.<name>` section."""
    return {s[len(b".text.") :].decode() for s in cubin.split(b"\x00") if s.startswith(b".text._Z")}


@dataclass
class _Build:
    source: str
    arch: str
    error: str | None  # nvcc's command and output when it failed
    kernels: set[str]  # mangled names of the kernels in the cubin


def _compile(nvcc: str, workdir: Path, source: str, arch: str) -> _Build:
    text, _ = _instantiation_unit(source)
    stem = f"{Path(source).stem}_{arch}"
    cu, cubin = workdir / f"{stem}.cu", workdir / f"{stem}.cubin"
    cu.write_text(text)
    cmd = [nvcc, "-cubin", f"-arch={arch}", *ks.COMPILE_OPTIONS, "-o", str(cubin), str(cu)]
    # a guard against a hung nvcc, not a speed limit: quant_gemv.cu's 90 instantiations took 158 s for one arch on
    # the 2-core VM at load 7.4 (113 s before its fp32-scale ones), and two archs compile at once
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return _Build(source, arch, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}", set())
    return _Build(source, arch, None, _kernel_symbols(cubin.read_bytes()))


def test_every_instantiation_compiles_with_nvcc_for_sm80_and_sm90():
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed: the CUDA kernel sources cannot be compiled here")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        # the heaviest file first, so that the two workers finish together
        jobs = sorted(((s, a) for s in ks.SOURCES for a in ARCHS), key=lambda j: j[0] != "paged_attention.cu")
        builds = list(pool.map(lambda job: _compile(nvcc, Path(tmp), *job), jobs))
    for build in builds:
        assert build.error is None, f"nvcc failed on {build.source} for {build.arch}:\n{build.error}"
        for template in ks.KERNELS:
            if template.source != build.source:
                continue
            # a template's mangled name starts _Z<len><name>I, its template arguments following
            found = {k for k in build.kernels if k.startswith(f"_Z{len(template.name)}{template.name}I")}
            assert len(found) == len(template.instantiations), (
                f"{build.source} for {build.arch}: {len(found)} kernels of {template.name}, "
                f"{len(template.instantiations)} instantiations listed:\n" + "\n".join(sorted(build.kernels))
            )
        exprs = _instantiation_unit(build.source)[1]
        assert len(build.kernels) == len(exprs), f"{build.source}: kernels that no instantiation asked for"


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
