"""The CPU kernels' fallbacks for compilers without __builtin_shufflevector (GCC before 12): the attention and LoRA
sources built with -DLORALEDGER_NO_SUMS_OF (per-lane sums instead of gpu/kernels/cpu_vectors.h's shuffle trees)
give the same results as the usual build, to rounding, on generated operands. Without the fallbacks an older GCC
failed to build the attention kernel at all and every step ran the slower torch path."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.gpu.cpu_kernel_marks import CPU_KERNEL_TESTS

pytestmark = CPU_KERNEL_TESTS

KERNELS = Path(__file__).resolve().parents[2] / "gpu" / "kernels"
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
ATTENTION_ARGS = (_I, _P, _I, _I, _P, _P, _I, _I, _I, _I, _P, _I, _I, _P, _I, _I, _F, _I, _F, _P, _P)
LORA_ARGS = (_P, _I, _I, _P, _I, _P, _I, _P, _I, _I, _I, _P, _I, _P, _I, _P, _P, _P, _P)


def _build(tmp: Path, source: str, *defines: str) -> ctypes.CDLL:
    out = tmp / f"{Path(source).stem}{'-'.join(('', *defines))}.so"
    flags = ["-O3", "-march=native", "-Wno-psabi", "-shared", "-fPIC", *(f"-D{d}" for d in defines)]
    subprocess.run(["cc", *flags, "-o", str(out), str(tmp / source), "-lm"], check=True, capture_output=True)
    return ctypes.CDLL(str(out))


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernels")
    for name in ("attention_cpu.c", "lora_cpu.c", "cpu_vectors.h"):
        shutil.copy(KERNELS / name, tmp / name)
    return {
        source: (_build(tmp, source), _build(tmp, source, "LORALEDGER_NO_SUMS_OF"))
        for source in ("attention_cpu.c", "lora_cpu.c")
    }


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.bfloat16:  # a sum in another order may round to the neighbouring bf16
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-3)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_attention_fallback_equals_the_usual_build(builds, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    batch, hk, group, block = 1 + seed % 4, 1 + seed % 2, (1, 2, 4)[seed % 3], (1, 5, 16)[seed % 3]
    d = (8, 40, 64, 128, 3, 16)[seed]
    hq, lens = hk * group, torch.randint(1, 70, (batch,), generator=g, dtype=torch.int32)
    width = -(-int(lens.max()) // block)
    blocks = batch * width
    k = torch.randn(blocks, block, hk, d, generator=g).to(dtype)
    v = torch.randn(blocks, block, hk, d, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g).to(torch.int32).reshape(batch, width)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    outs = []
    for lib in builds["attention_cpu.c"]:
        fn = lib.paged_decode_attention
        fn.argtypes, fn.restype = ATTENTION_ARGS, ctypes.c_int64
        out = torch.empty_like(q)
        scratch = torch.empty(hq * (2 * d + -(-block // 16) * 16 + 2))
        window = (0, 7)[seed % 2]
        rc = fn(
            int(dtype == torch.bfloat16), q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), blocks,
            block, hk, d, tables.data_ptr(), width, width, lens.data_ptr(), batch, hq, d**-0.5, window, 0.0,
            out.data_ptr(), scratch.data_ptr(),
        )  # fmt: skip
        assert rc == 0
        outs.append(out)
    _close(outs[1], outs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_lora_fallback_equals_the_usual_build(builds, dtype, seed):
    g = torch.Generator().manual_seed(100 + seed)
    slots, rank, slices, features = (
        1 + seed % 3,
        (16, 8, 5, 3, 1, 4)[seed],
        1 + seed % 3,
        (512, 33, 100, 64, 7, 16)[seed],
    )
    widths = [(768, 17, 40, 64, 5, 16)[(seed + i) % 6] for i in range(slices)]
    out_total, tokens = sum(widths), 2 + seed * 2
    x = torch.randn(tokens, features, generator=g).to(dtype)
    a = torch.randn(slots, slices * rank, features, generator=g).to(dtype)
    b = torch.randn(slots, rank, out_total, generator=g).to(dtype)
    slot_ranks = torch.randint(1, rank + 1, (slots,), generator=g, dtype=torch.int32)
    offsets = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int64)
    order = torch.randperm(tokens, generator=g)
    groups = min(slots, tokens)
    group_slot = torch.arange(groups, dtype=torch.int64)
    group_start = torch.linspace(0, tokens, groups + 1).round().to(torch.int64)
    y0 = torch.randn(tokens, out_total, generator=g).to(dtype)
    outs = []
    for lib in builds["lora_cpu.c"]:
        fn = lib.lora_grouped_f32 if dtype == torch.float32 else lib.lora_grouped_bf16
        fn.argtypes, fn.restype = LORA_ARGS, ctypes.c_int
        y = y0.clone()
        scratch = torch.zeros(4 * features + 4 * slices * rank + 64)
        fn(
            x.data_ptr(), features, features, a.data_ptr(), slices * rank * features, b.data_ptr(), rank * out_total,
            y.data_ptr(), out_total, out_total, slices, offsets.data_ptr(), rank, slot_ranks.data_ptr(), groups,
            group_slot.data_ptr(), group_start.data_ptr(), order.to(torch.int64).data_ptr(), scratch.data_ptr(),
        )  # fmt: skip
        outs.append(y)
    assert not torch.equal(outs[0], y0)  # the delta was added
    _close(outs[1], outs[0])
