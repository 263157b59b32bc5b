"""Every kernel instantiation compiled with nvcc into a cubin, and the check that the cubin holds exactly the listed
kernels. The suite (tests/gpu/test_kernel_sources.py) compiles SUITE_BUILDS; every source for every arch:

    python -m tests.gpu.nvcc_builds            # sm_80 and sm_90, every source; exit 1 naming what failed
    python -m tests.gpu.nvcc_builds --arch sm_90 --source quant_gemv.cu

Compiling is the slow part (quant_gemv.cu's 90 instantiations: 22 s for one arch on the 2-core AMD EPYC, AVX512-BF16,
at load 3), so the suite compiles each source once, for sm_90, and the one source whose code differs by arch (its
cluster kernel, whose sm_90-only instructions compile to a trap below sm_90) for every arch.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from loraledger.gpu import kernel_sources as ks

ARCHS = ("sm_80", "sm_90")
SUITE_ARCH = "sm_90"


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def arch_dependent(source: str) -> bool:
    """Whether the source's code differs by arch: it holds a cluster kernel (common.cuh's sm_90-only helpers)."""
    return any(k.source == source and k.cluster > 1 for k in ks.KERNELS)


def suite_builds() -> list[tuple[str, str]]:
    """(source, arch) the suite compiles: each source for SUITE_ARCH, an arch-dependent one for every arch."""
    return [(s, a) for s in ks.SOURCES for a in ARCHS if a == SUITE_ARCH or arch_dependent(s)]


def instantiation_unit(source: str) -> tuple[str, tuple[str, ...]]:
    """The source as CuPy compiles it, plus host references that force each name expression to be instantiated."""
    exprs = tuple(e for k in ks.KERNELS if k.source == source for e in k.expressions())
    refs = ",\n    ".join(f"reinterpret_cast<void*>(&{e})" for e in exprs)
    return f"{ks.load_source(source)}\n\nvoid* loraledger_instances[] = {{\n    {refs}\n}};\n", exprs


def kernel_symbols(cubin: bytes) -> set[str]:
    """Mangled names of the kernels in a cubin: each has its own `.text.<name>` section."""
    return {s[len(b".text.") :].decode() for s in cubin.split(b"\x00") if s.startswith(b".text._Z")}


@dataclass
class Build:
    source: str
    arch: str
    error: str | None  # nvcc's command and output when it failed
    kernels: set[str]  # mangled names of the kernels in the cubin


def compile_unit(compiler: str, workdir: Path, source: str, arch: str) -> Build:
    text, _ = instantiation_unit(source)
    stem = f"{Path(source).stem}_{arch}"
    cu, cubin = workdir / f"{stem}.cu", workdir / f"{stem}.cubin"
    cu.write_text(text)
    cmd = [compiler, "-cubin", f"-arch={arch}", *ks.COMPILE_OPTIONS, "-o", str(cubin), str(cu)]
    # a guard against a hung nvcc, not a speed limit: quant_gemv.cu's 90 instantiations took 158 s for one arch on
    # the 2-core VM at load 7.4, and two compile at once
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return Build(source, arch, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}", set())
    return Build(source, arch, None, kernel_symbols(cubin.read_bytes()))


def compile_all(compiler: str, jobs: list[tuple[str, str]]) -> list[Build]:
    """Compile (source, arch) jobs two at a time, the heaviest files first so that the two workers end together."""
    heavy = ("quant_gemv.cu", "paged_attention.cu")
    order = sorted(jobs, key=lambda j: heavy.index(j[0]) if j[0] in heavy else len(heavy))
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda job: compile_unit(compiler, Path(tmp), *job), order))


def problems(build: Build) -> list[str]:
    """What is wrong with one build: nvcc failed, or its cubin holds other kernels than the listed instantiations."""
    if build.error is not None:
        return [f"nvcc failed on {build.source} for {build.arch}:\n{build.error}"]
    found = []
    for template in ks.KERNELS:
        if template.source != build.source:
            continue
        # a template's mangled name starts _Z<len><name>I, its template arguments following
        mine = {k for k in build.kernels if k.startswith(f"_Z{len(template.name)}{template.name}I")}
        if len(mine) != len(template.instantiations):
            found.append(
                f"{build.source} for {build.arch}: {len(mine)} kernels of {template.name}, "
                f"{len(template.instantiations)} instantiations listed:\n" + "\n".join(sorted(build.kernels))
            )
    if len(build.kernels) != len(instantiation_unit(build.source)[1]):
        found.append(f"{build.source} for {build.arch}: kernels that no instantiation asked for")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--arch", action="append", choices=ARCHS, help="default: every arch")
    parser.add_argument("--source", action="append", choices=ks.SOURCES, help="default: every source")
    args = parser.parse_args(argv)
    compiler = nvcc()
    if compiler is None:
        print("nvcc is not installed: the CUDA kernel sources cannot be compiled here", file=sys.stderr)
        return 1
    jobs = [(s, a) for s in args.source or ks.SOURCES for a in args.arch or ARCHS]
    failed = 0
    for build in compile_all(compiler, jobs):
        found = problems(build)
        failed += bool(found)
        print(f"{build.source:20} {build.arch}: " + ("\n".join(found) if found else f"{len(build.kernels)} kernels"))
    print(f"{len(jobs) - failed} of {len(jobs)} builds hold exactly their listed instantiations")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
