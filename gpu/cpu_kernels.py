"""The CPU kernels' build: a C source of gpu/kernels compiled at first use with the system's C compiler, loaded
with ctypes (gpu/lora_cpu_kernel.py, gpu/argmax_cpu_kernel.py, ...); the headers of gpu/kernels (what the kernels
share, gpu/kernels/cpu_vectors.h) sit beside the source when it is compiled.

Built with `$CC`, else cc, gcc or clang; `-O3 -march=native` first, so the vectors are the CPU's own, then without
-march=native. Into the cache folder (loraledger.paths.cache_dir()/cpu-kernels), named by a digest of the source,
the headers, the compiler, its flags and the CPU's flags, so a changed source or another CPU builds anew; written to a temporary
name and renamed, so concurrent builds never load half a file. No compiler, a failed or timed-out build, or
`LORALEDGER_CPU_KERNELS=0`: the caller runs its plain-torch path instead, with a warning logged once per kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

from loraledger import paths
from loraledger.gpu import cpu_features
from loraledger.logging import get_logger

DISABLE_ENV = "LORALEDGER_CPU_KERNELS"  # "0": never build or load a CPU kernel
# the element type a kernel taking either is told, as its `dtype` argument (0 = fp32, 1 = bf16 in every source)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
BUILD_SECONDS = 120  # a compiler that takes longer is treated as a failed build
# The first that builds: -march=native (the vectors are the CPU's own), then without it (they split into what the
# ABI's baseline has). -Wno-psabi: the vector helpers are static, no vector crosses the library's edge.
FLAG_SETS = (("-O3", "-march=native", "-Wno-psabi"), ("-O3", "-Wno-psabi"))

log = get_logger("cpu_kernels")


@functools.cache
def library(source: str) -> tuple[ctypes.CDLL, Path] | None:
    """(the loaded library, its file) of gpu/kernels/`source`, built on first use (cached on disk); None where it
    cannot be built or kernels are switched off."""
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found ($CC, cc, gcc, clang): the plain-torch path runs instead", kernel=source)
        return None
    kernels = resources.files("loraledger.gpu").joinpath("kernels")
    text = kernels.joinpath(source).read_bytes()
    headers = {p.name: p.read_bytes() for p in sorted(kernels.iterdir(), key=lambda p: p.name) if p.name.endswith(".h")}
    errors = []
    for flags in FLAG_SETS:
        path = _library_path(source, text, headers, compiler, flags)
        try:
            if not path.exists():
                started = time.perf_counter()
                _build(text, headers, compiler, flags, path)
                log.info("built a CPU kernel", path=str(path), flags=" ".join(flags),
                         seconds=round(time.perf_counter() - started, 2))  # fmt: skip
            return ctypes.CDLL(str(path)), path
        except subprocess.TimeoutExpired:
            errors.append(f"{' '.join(flags)}: no result within {BUILD_SECONDS} s")
            break  # a compiler that hangs once will hang again: no more tries
        except OSError as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
    log.warning("a CPU kernel did not build: the plain-torch path runs instead", kernel=source, errors=errors)
    return None


@functools.cache
def function(source: str, name: str, argtypes: tuple, restype=ctypes.c_int64):
    """The C function `name` of gpu/kernels/`source`, typed (argtypes, restype); None where the library cannot be
    built or kernels are switched off."""
    built = library(source)
    if built is None:
        return None
    fn = getattr(built[0], name)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


def _compiler() -> str | None:
    named = os.environ.get("CC", "").strip()
    candidates = [named] if named else ["cc", "gcc", "clang"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


def _library_path(name: str, source: bytes, headers: dict[str, bytes], compiler: str, flags: tuple[str, ...]) -> Path:
    digest = hashlib.blake2b(digest_size=10)  # a cache key, not an audit digest
    shared = [part for header, text in headers.items() for part in (header.encode(), text)]
    for part in (source, *shared, compiler.encode(), " ".join(flags).encode(), _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return paths.cache_dir() / "cpu-kernels" / f"{Path(name).stem}-{digest.hexdigest()}.so"


def _cpu_identity() -> str:
    """What -march=native compiles for: the machine and its instruction-set flags."""
    try:
        flags = cpu_features.cpu_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        flags = frozenset()
    return f"{platform.machine()} {platform.processor()} {' '.join(sorted(flags))}"


def _build(source: bytes, headers: dict[str, bytes], compiler: str, flags: tuple[str, ...], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        src = Path(work) / "kernel.c"
        src.write_bytes(source)
        for header, text in headers.items():  # beside the source: `#include "name.h"` finds them
            (Path(work) / header).write_bytes(text)
        out = Path(work) / path.name
        result = subprocess.run(
            [compiler, *flags, "-shared", "-fPIC", "-o", str(out), str(src)],
            capture_output=True,
            text=True,
            timeout=BUILD_SECONDS,
            check=False,
        )
        if result.returncode != 0:
            raise OSError(f"{Path(compiler).name} exited {result.returncode}: {result.stderr.strip()[-400:]}")
        os.replace(out, path)  # atomic: another process sees no file or the whole one
