"""The CUDA kernel sources: their files, kernel templates and instantiations, compile options, and the text loader.

The `.cu` files under gpu/kernels are compiled at run time by CuPy (NVRTC) with COMPILE_OPTIONS,
one module per kernel instantiation, named by its C++ name expression (`lora_shrink_kernel<bf16_t, 1, 4>`).
The same list drives tests/gpu/nvcc_builds.py, which compiles every instantiation with nvcc for
sm_80 and sm_90, so a kernel that CudaOps can ask for is a kernel that compiles.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from importlib import resources

import torch

from loraledger.errors import KernelInputError

COMPILE_OPTIONS: tuple[str, ...] = ("-std=c++17",)
COMMON_HEADER = "common.cuh"
_INCLUDE_COMMON = re.compile(rf'^#include "{re.escape(COMMON_HEADER)}"[ \t]*$', re.MULTILINE)

# torch dtype -> the kernels' element type (common.cuh)
ELEMENT_TYPES: dict[torch.dtype, str] = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}
# torch dtype -> index type of positions / slot_mapping
INDEX_TYPES: dict[torch.dtype, str] = {torch.int64: "long long", torch.int32: "int"}

# Launch geometry the kernels are written for (mirrored by constexprs in the .cu files; the test checks).
LORA_SHRINK_THREADS = 128
LORA_EXPAND_THREADS = 256
LORA_FUSED_THREADS = 128
LORA_FUSED_CLUSTER = 8  # blocks per token in the fused decode kernel (the portable cluster maximum)
ATTENTION_THREADS = 128
QUANT_GEMV_THREADS = 128
QUANT_GEMV_ROWS = 2  # output rows per warp
DEQUANT_THREADS = 256

# Weight-only quantized projections: weight bits, scale element types, tokens per GEMV pass. fp32 scales hold what
# no 16-bit float holds exactly (GGUF Q4_K's d * 6-bit sub-scale products, bitsandbytes int8's SCB / 127).
QUANT_BITS = (4, 8)
QUANT_SCALE_TYPES: dict[torch.dtype, str] = {torch.bfloat16: "bf16_t", torch.float16: "f16_t", torch.float32: "float"}
QUANT_GEMV_TOKENS = (1, 2, 4, 8)

# LoRA tiling: BGMV = one token per block; SGMV = tiles of up to SGMV_TILE tokens of one slot.
BGMV_SHRINK_ROWS = 4
SGMV_TILE = 8
SGMV_SHRINK_ROWS = 4

# Paged attention: query heads per pass (HP), head elements per lane (EPL), tokens per lane per chunk (U).
ATTENTION_HEADS_PER_PASS = (1, 2, 4, 8)
ATTENTION_ELEMS_PER_LANE: dict[str, tuple[int, ...]] = {"float": (4, 8), "bf16_t": (8,), "f16_t": (8,)}
ATTENTION_MAX_HEAD_DIM = 256
_ELEMENT_BYTES = {"float": 4, "bf16_t": 2, "f16_t": 2}


def attention_tokens_per_lane(ctype: str, hp: int, epl: int) -> int:
    """U: how many tokens' K and V rows each lane has in flight per chunk (twice that with the prefetch).

    Enough 16-byte loads in flight to cover the memory latency, within the registers a 128-thread
    block can have at 3 blocks per SM: the raw rows in flight take 4 * U * EPL * bytes / 4 registers
    on top of the HP * EPL of q and of the accumulator each. Two 16-byte rows per lane is the base:
    measured on an H100 (bf16, 4 query heads per pass, `bench/kernels.py --sweep`), U = 2 reached 55 %
    of copy bandwidth where U = 4 reached 42-45 % and U = 8 33-38 %: more resident blocks hide the
    latency better than more rows in flight per lane. One query head per pass takes twice the base,
    eight heads half.
    """
    u = 32 // (epl * _ELEMENT_BYTES[ctype])
    if hp == 1:
        u *= 2
    elif hp >= 8:
        u //= 2
    return max(1, u)


@dataclass(frozen=True)
class KernelTemplate:
    """One `__global__` template in one source file, with every instantiation CudaOps may launch.

    cluster > 1: the kernel declares that many blocks per thread block cluster (`__cluster_dims__`,
    sm_90); a launch's grid.x must be a multiple of it. Only the CPU emulation needs to be told.
    """

    name: str
    source: str
    instantiations: tuple[tuple[str, ...], ...]
    cluster: int = 1

    def expression(self, *args: object) -> str:
        """The C++ name expression of one instantiation (the key NVRTC and CuPy know it by)."""
        targs = tuple(str(a) for a in args)
        if targs not in self.instantiations:
            raise KernelInputError(
                f"{self.name} has no instantiation <{', '.join(targs)}>; "
                f"available: {['<' + ', '.join(i) + '>' for i in self.instantiations]}"
            )
        return _expr(self.name, targs)

    def expressions(self) -> tuple[str, ...]:
        return tuple(_expr(self.name, targs) for targs in self.instantiations)


def _expr(name: str, targs: tuple[str, ...]) -> str:
    return f"{name}<{', '.join(targs)}>"


_ELEMS = tuple(ELEMENT_TYPES.values())
_INDEXES = tuple(INDEX_TYPES.values())


def _grid(*axes: tuple[object, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(str(a) for a in combo) for combo in itertools.product(*axes))


LORA_SHRINK = KernelTemplate(
    "lora_shrink_kernel",
    "lora.cu",
    tuple(
        (t, str(toks), str(rows))
        for t in _ELEMS
        for toks, rows in ((1, BGMV_SHRINK_ROWS), (SGMV_TILE, SGMV_SHRINK_ROWS))
    ),
)
LORA_EXPAND = KernelTemplate("lora_expand_kernel", "lora.cu", _grid(_ELEMS, (1, SGMV_TILE)))
LORA_BGMV_FUSED = KernelTemplate("lora_bgmv_fused_kernel", "lora.cu", _grid(_ELEMS), cluster=LORA_FUSED_CLUSTER)
PAGED_ATTENTION_DECODE = KernelTemplate(
    "paged_attention_decode_kernel",
    "paged_attention.cu",
    tuple(
        (t, str(hp), str(epl), str(attention_tokens_per_lane(t, hp, epl)))
        for t in _ELEMS
        for hp in ATTENTION_HEADS_PER_PASS
        for epl in ATTENTION_ELEMS_PER_LANE[t]
    ),
)
PAGED_ATTENTION_REDUCE = KernelTemplate("paged_attention_reduce_kernel", "paged_attention.cu", _grid(_ELEMS))
WRITE_KV = KernelTemplate("write_kv_kernel", "kv_cache.cu", _grid(_ELEMS, _INDEXES))
RMS_NORM = KernelTemplate("rms_norm_kernel", "rms_norm.cu", _grid(_ELEMS))
ROTARY_EMBEDDING = KernelTemplate("rotary_embedding_kernel", "rotary.cu", _grid(_ELEMS, _INDEXES))
SILU_AND_MUL = KernelTemplate("silu_and_mul_kernel", "activation.cu", _grid(_ELEMS))
_QUANT_SCALES = tuple(QUANT_SCALE_TYPES.values())
QUANT_GEMV = KernelTemplate(
    "quant_gemv_kernel", "quant_gemv.cu", _grid(_ELEMS, _QUANT_SCALES, QUANT_BITS, QUANT_GEMV_TOKENS)
)
QUANT_DEQUANTIZE = KernelTemplate("quant_dequantize_kernel", "quant_gemv.cu", _grid(_QUANT_SCALES, QUANT_BITS, _ELEMS))

KERNELS: tuple[KernelTemplate, ...] = (
    LORA_SHRINK,
    LORA_EXPAND,
    LORA_BGMV_FUSED,
    PAGED_ATTENTION_DECODE,
    PAGED_ATTENTION_REDUCE,
    WRITE_KV,
    RMS_NORM,
    ROTARY_EMBEDDING,
    SILU_AND_MUL,
    QUANT_GEMV,
    QUANT_DEQUANTIZE,
)
SOURCES: tuple[str, ...] = tuple(dict.fromkeys(k.source for k in KERNELS))


def _read(filename: str) -> str:
    return resources.files("loraledger.gpu").joinpath("kernels", filename).read_text(encoding="utf-8")


def load_source(filename: str) -> str:
    """The compilable text of one kernel file: common.cuh pasted in place of its #include.

    NVRTC then needs no include path, and the text that CuPy compiles is exactly the text
    the nvcc test compiles.
    """
    if filename not in SOURCES:
        raise KernelInputError(f"unknown kernel source {filename!r}; known: {list(SOURCES)}")
    common = _read(COMMON_HEADER)
    return _INCLUDE_COMMON.sub(lambda _: common, _read(filename), count=1)
