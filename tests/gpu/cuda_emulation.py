"""EmulatedLauncher: runs CudaOps' kernel launches on CPU tensors through a g++ build of the kernels (cuda_emulation.h).

It checks the kernels' logic (indexing, tiling, reductions, barriers, alignment decisions) where
no GPU is present; the GPU tests check the same ops on the real device.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from loraledger.gpu import kernel_sources as ks

_HEADER = Path(__file__).with_name("cuda_emulation.h")
_CACHE = Path(tempfile.gettempdir()) / "loraledger-cuda-emulation"
# -O0 builds twice as fast as -O1 and the emulated sweeps are small; the sanitizer is the point
_CXX_FLAGS = (
    "-std=c++20",
    "-O0",
    "-shared",
    "-fPIC",
    "-Wno-unknown-pragmas",
    "-fsanitize=alignment",
    "-fno-sanitize-recover=all",
)
# CudaOps passes every kernel argument as one of these numpy scalars (pointers as uint64)
_ARG_TYPES = {
    np.uint64: ctypes.c_uint64,
    np.int64: ctypes.c_int64,
    np.int32: ctypes.c_int32,
    np.float32: ctypes.c_float,
}


def emulation_problem() -> str | None:
    """Why the kernels cannot be emulated here, or None."""
    if shutil.which("g++") is None:
        return "g++ is not installed: the CUDA kernels cannot be emulated on the CPU"
    return None


def _host_source(source: str) -> str:
    """The kernel text with its three device-only constructs swapped for host equivalents."""
    text = ks.load_source(source)
    text = re.sub(r'asm\("cvt\.f32\.f16 %0, %1;" : "=f"\((\w+)\) : "h"\(([\w.]+)\)\);', r"\1 = emu_h2f(\2);", text)
    text = re.sub(r'asm\("cvt\.rn\.f16\.f32 %0, %1;" : "=h"\(([\w.]+)\) : "f"\((\w+)\)\);', r"\1 = emu_f2h(\2);", text)
    text = re.sub(
        r"extern __shared__ float (\w+)\[\];", r"float* \1 = reinterpret_cast<float*>(emu::block_smem());", text
    )
    # the PTX cluster helpers: cuda_emulation.h has host versions
    text = re.sub(
        r"#ifndef LORALEDGER_HOST_EMULATION\n.*?#endif  // LORALEDGER_HOST_EMULATION\n", "", text, flags=re.DOTALL
    )
    if "asm(" in text:
        raise AssertionError(f"{source} has inline PTX the emulation does not translate")
    return text


# two translation units of about equal g++ time, built in parallel
_UNITS = (("paged_attention.cu",), tuple(s for s in ks.SOURCES if s != "paged_attention.cu"))


def _build(unit: tuple[str, ...]) -> tuple[Path, list[str]]:
    """Compile one unit (cached by content) and return its library and the name expressions it exports, in order."""
    exprs = [e for k in ks.KERNELS if k.source in unit for e in k.expressions()]
    # common.cuh's include guard keeps the second and later pasted copies out
    code = _HEADER.read_text() + "".join(_host_source(source) for source in unit)
    for i, expr in enumerate(exprs):
        code += (
            f'\nextern "C" void emu_launch_{i}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
            f"unsigned long long smem, void** args, unsigned cluster) {{ emu_launch(&{expr}, dim3{{gx, gy, gz}}, "
            f"dim3{{bx, 1, 1}}, smem, args, cluster); }}\n"
        )
    key = hashlib.sha256(code.encode()).hexdigest()[:16]
    _CACHE.mkdir(exist_ok=True)
    lib = _CACHE / f"kernels-{key}.so"
    if not lib.exists():
        # private build files, renamed into place: concurrent test runs may build the same unit
        with tempfile.TemporaryDirectory(dir=_CACHE) as tmp:
            cpp, out = Path(tmp) / "kernels.cpp", Path(tmp) / "kernels.so"
            cpp.write_text(code)
            proc = subprocess.run(["g++", *_CXX_FLAGS, "-o", str(out), str(cpp)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise AssertionError(f"g++ failed on the emulated kernels {unit}:\n{proc.stderr}")
            out.replace(lib)
    return lib, exprs


class EmulatedLauncher:
    """A KernelLauncher (gpu/kernel_launcher.py) whose kernels run on the CPU; sm_count shapes the split heuristics."""

    def __init__(self, sm_count: int = 4, compute_capability: tuple[int, int] = (9, 0)) -> None:
        self.sm_count = sm_count
        self.compute_capability = compute_capability
        with ThreadPoolExecutor(max_workers=len(_UNITS)) as pool:
            built = list(pool.map(_build, _UNITS))
        self._kernels: dict[str, Any] = {}
        for path, exprs in built:
            lib = ctypes.CDLL(str(path))
            for i, expr in enumerate(exprs):
                self._kernels[expr] = getattr(lib, f"emu_launch_{i}")

    def launch(
        self,
        template: ks.KernelTemplate,
        targs: tuple[object, ...],
        grid: tuple[int, ...],
        block: int,
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None:
        fn = self._kernels[template.expression(*targs)]
        values = [_ARG_TYPES[type(a)](a.item()) for a in args]
        argv = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        dims = (*grid, 1, 1)[:3]
        fn(
            *(ctypes.c_uint(d) for d in dims),
            ctypes.c_uint(block),
            ctypes.c_ulonglong(shared_mem),
            argv,
            ctypes.c_uint(template.cluster),
        )
