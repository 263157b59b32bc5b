"""What this CPU's instruction set makes fast: whether bf16 matrix products run natively (AVX512-BF16 or AMX)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

# Linux /proc/cpuinfo flag names of the instructions that multiply bf16 natively
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# what oneDNN's bf16 weight reorder needs of the CPU, whatever the override says: without it the reorder raises
BF16_REORDER_FLAG_SETS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))
# "0" or "1" overrides the detection (for instance "0" keeps dtype="auto" at fp32, exact, on a bf16-capable CPU)
OVERRIDE_ENV = "LORALEDGER_CPU_NATIVE_BF16"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags named on the first "flags" line of a /proc/cpuinfo text (empty when there is none)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def native_bf16() -> bool:
    """True on a CPU with AVX512-BF16 or AMX, where oneDNN's bf16 GEMMs beat fp32 by streaming half the bytes;
    False elsewhere (other CPUs emulate bf16, slower than fp32) and where /proc/cpuinfo cannot be read.
    $LORALEDGER_CPU_NATIVE_BF16 set to "0" or "1" decides instead of the CPU's flags."""
    override = os.environ.get(OVERRIDE_ENV, "").strip()
    if override in ("0", "1"):
        return override == "1"
    return bool(_this_cpu() & NATIVE_BF16_FLAGS)


@functools.cache
def bf16_reorder_possible() -> bool:
    """True where oneDNN can pre-pack a bf16 weight (AVX512BW+VL+DQ, or AVX-NE-CONVERT): an AVX2-only CPU cannot,
    even with $LORALEDGER_CPU_NATIVE_BF16=1."""
    flags = _this_cpu()
    return any(need <= flags for need in BF16_REORDER_FLAG_SETS)


@functools.cache
def amx_bf16() -> bool:
    """True on a CPU with AMX's bf16 tiles, which oneDNN's bf16 GEMMs use (False where /proc/cpuinfo cannot be read)."""
    return "amx_bf16" in _this_cpu()


@functools.cache
def _this_cpu() -> frozenset[str]:
    """This CPU's flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return frozenset()
