"""Tests for gpu/ops_quant.py: CudaOps.quant_linear (the W4A16 / W8A16 GEMV, the dequantize + matmul prefill) equals
its torch twin on random weights in the device layout: odd output counts, several group sizes, with and without
zero points and offsets, GPTQ's column order, every activation dtype.

As in test_ops_cuda.py, the checks run in the ordinary suite through the CPU emulation of the kernels over small
shapes, and on a GPU (`gpu` marker) over decode shapes of the 1B and 8B models. Outputs the kernels allocate are
NaN-poisoned, so an element never written fails.
"""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch

from loraledger.errors import KernelInputError
from loraledger.gpu.ops_cuda import CudaOps
from loraledger.gpu.ops_quant import GEMV_MAX_TOKENS, gemv_tokens, quant_dequantize_twin, quant_linear_twin
from loraledger.quantization.device_layout import DeviceQuantWeight, from_affine, from_zero_point
from tests.gpu.cuda_emulation import EmulatedLauncher, emulation_problem
from tests.gpu.markers import requires_gpu
from tests.gpu.test_ops_cuda import _gen, assert_matches, poisoned_allocations

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture(scope="module")
def emulated() -> CudaOps:
    problem = emulation_problem()
    if problem is not None:
        pytest.skip(problem)
    return CudaOps("cpu", launcher=EmulatedLauncher(sm_count=4))


@pytest.fixture(scope="module")
def on_gpu() -> CudaOps:
    return CudaOps("cuda")


def random_weight(
    n: int, k: int, bits: int, group: int, kind: str, scale_dtype: torch.dtype, device: str, seed: object
) -> DeviceQuantWeight:
    """kind: "sym" (no zero points), "zeros" (per-group integer zero points), "offsets" (GGUF Q4_1's min),
    "perm" (zero points and a GPTQ desc_act column order)."""
    g = _gen("quant-weight", n, k, bits, group, kind, scale_dtype, seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.05 + 0.005).to(scale_dtype).float()
    if kind == "offsets":
        offset = (torch.randn(n, k // group, generator=g) * 0.1).to(scale_dtype).float()
        weight = from_affine(q, scale, offset, bits, scale_dtype=scale_dtype)
        assert weight.offsets is not None
    else:
        zero = torch.full_like(scale, 2.0 ** (bits - 1))
        if kind in ("zeros", "perm"):
            zero = torch.randint(0, 2**bits + 1, scale.shape, generator=g).float()
        perm = torch.randperm(k, generator=g) if kind == "perm" else None
        weight = from_zero_point(q, scale, zero, bits, scale_dtype=scale_dtype, perm=perm)
        assert (weight.zeros is None) == (kind == "sym")
    return weight.to(device)


def check_quant_linear(
    ops: CudaOps,
    device: str,
    dtype: torch.dtype,
    rows: int,
    n: int,
    k: int,
    bits: int,
    group: int,
    kind: str,
    scale_dtype: torch.dtype = F16,
) -> None:
    weight = random_weight(n, k, bits, group, kind, scale_dtype, device, (dtype, rows))
    x = torch.randn(rows, k, generator=_gen("quant-x", dtype, rows, n, k, bits, group, kind)).to(dtype).to(device)
    with poisoned_allocations():
        got = ops.quant_linear(x, weight)
    ref = quant_linear_twin(x.cpu(), weight.to("cpu"))
    assert got.dtype == dtype
    assert_matches(f"quant_linear {bits}-bit g{group} {kind} rows {rows}", got, ref, dtype)


def check_dequantize(ops: CudaOps, device: str, dtype: torch.dtype, n: int, k: int, bits: int, group: int, kind: str):
    weight = random_weight(n, k, bits, group, kind, BF16, device, "dequantize")
    with poisoned_allocations():
        got = ops.quant_dequantize(weight, dtype)
    # fp32 arithmetic in the same order: (q - zero) * scale is exact, + offset rounds once, then once to dtype
    assert torch.equal(got.cpu(), quant_dequantize_twin(weight.to("cpu"), dtype))


# ---- emulated (ordinary suite) ----

EMULATED_CASES = [  # rows, n, k, bits, group, kind
    (1, 37, 256, 4, 32, "sym"),
    (1, 5, 128, 4, 128, "zeros"),
    (2, 19, 192, 4, 64, "offsets"),
    (3, 16, 256, 4, 128, "perm"),
    (5, 9, 128, 4, 32, "zeros"),
    (8, 21, 128, 4, 64, "sym"),
    (1, 13, 96, 8, 16, "zeros"),
    (4, 11, 128, 8, 128, "sym"),
    (7, 6, 64, 8, 32, "offsets"),
    (11, 17, 128, 4, 32, "zeros"),  # above GEMV_MAX_TOKENS: dequantize + matmul
]


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize(("rows", "n", "k", "bits", "group", "kind"), EMULATED_CASES)
def test_quant_linear_emulated(emulated, dtype, rows, n, k, bits, group, kind):
    check_quant_linear(emulated, "cpu", dtype, rows, n, k, bits, group, kind)


def test_quant_linear_bf16_scales_and_leading_dims_emulated(emulated):
    check_quant_linear(emulated, "cpu", BF16, 2, 7, 128, 4, 32, "zeros", scale_dtype=BF16)
    weight = random_weight(9, 64, 4, 32, "sym", F16, "cpu", "3d")
    x = torch.randn(2, 1, 64, generator=_gen("3d")).to(BF16)
    got = emulated.quant_linear(x, weight)
    assert got.shape == (2, 1, 9)
    assert_matches("quant_linear [2, 1, K]", got, quant_linear_twin(x, weight), BF16)


@pytest.mark.parametrize(("rows", "bits", "kind"), [(3, 4, "offsets"), (1, 8, "sym"), (12, 4, "offsets")])
def test_quant_linear_fp32_scales_emulated(emulated, rows, bits, kind):
    """fp32 scales and offsets (GGUF Q4_K's, bitsandbytes int8's: no 16-bit float holds them) in the GEMV and the
    dequantize + matmul path."""
    assert random_weight(10, 128, bits, 32, kind, F32, "cpu", (BF16, rows)).scales.dtype == F32
    check_quant_linear(emulated, "cpu", BF16, rows, 10, 128, bits, 32, kind, scale_dtype=F32)


def test_dequantize_of_q4_k_scales_is_exact_emulated(emulated):
    """Q4_K's scales and mins are an fp16 times a 6-bit integer (17 significant bits): (q - zero) * scale stays exact
    in fp32, so the kernel's fused multiply-add and the twin's two steps round the same, once."""
    g = _gen("q4k-scales")
    q = torch.randint(0, 16, (6, 256), generator=g)
    d = (torch.rand(6, 8, generator=g) * 0.01).half().float()
    scale = d * torch.randint(1, 64, (6, 8), generator=g)
    offset = -d * torch.randint(0, 64, (6, 8), generator=g)
    weight = from_affine(q, scale, offset, 4)
    assert weight.scales.dtype == F32 and weight.offsets is not None
    for dtype in (F32, BF16):
        with poisoned_allocations():
            got = emulated.quant_dequantize(weight, dtype)
        assert torch.equal(got, quant_dequantize_twin(weight, dtype))


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize(("bits", "group", "kind"), [(4, 32, "zeros"), (4, 128, "offsets"), (8, 64, "sym")])
def test_dequantize_emulated_is_exact(emulated, dtype, bits, group, kind):
    check_dequantize(emulated, "cpu", dtype, 7, 256, bits, group, kind)


def test_decode_rows_run_the_gemv_and_prefill_rows_dequantize_once(emulated):
    weight = random_weight(17, 64, 4, 32, "sym", F16, "cpu", "dispatch")
    launched = []
    launch = emulated._launcher.launch

    def spy(template, targs, grid, block, args, shared_mem=0):
        launched.append((template.name, tuple(targs), grid))
        return launch(template, targs, grid, block, args, shared_mem)

    with mock.patch.object(emulated._launcher, "launch", spy):
        emulated.quant_linear(torch.randn(3, 64).to(BF16), weight)
        emulated.quant_linear(torch.randn(GEMV_MAX_TOKENS + 1, 64).to(BF16), weight)
    assert launched == [
        ("quant_gemv_kernel", ("bf16_t", "f16_t", 4, 4), (3, 1)),  # 17 outputs, 8 a block; 3 tokens in one pass
        ("quant_dequantize_kernel", ("f16_t", 4, "bf16_t"), (1,)),
    ]


def test_gemv_tokens_cover_the_rows_with_the_smallest_pass():
    assert [gemv_tokens(r) for r in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert GEMV_MAX_TOKENS == 8


def test_the_twin_is_the_dense_product_of_the_dequantized_weight():
    weight = random_weight(10, 64, 4, 32, "zeros", F16, "cpu", "twin")
    x = torch.randn(3, 64, generator=_gen("twin-x"))
    assert torch.allclose(quant_linear_twin(x, weight), x @ weight.dequantize().t(), atol=1e-5)


def test_quant_linear_refuses_what_the_kernels_cannot_read(emulated):
    weight = random_weight(8, 64, 4, 32, "sym", F16, "cpu", "bad")
    with pytest.raises(KernelInputError, match=r"x must have shape \[\.\.\., 64\]"):
        emulated.quant_linear(torch.randn(2, 32), weight)
    with pytest.raises(KernelInputError, match="x must be float32 or bfloat16 or float16"):
        emulated.quant_linear(torch.zeros(2, 64, dtype=torch.int32), weight)
    with pytest.raises(KernelInputError, match="weight must be a DeviceQuantWeight"):
        emulated.quant_linear(torch.randn(2, 64), torch.zeros(8, 64))
    with pytest.raises(KernelInputError, match=r"weight.qweight must have shape \[N, K \* bits / 32\]"):
        emulated.quant_linear(torch.randn(2, 64), replace(weight, qweight=weight.qweight[:, :4].contiguous()))
    with pytest.raises(KernelInputError, match="weight.scales must be bfloat16 or float16 or float32"):
        emulated.quant_linear(torch.randn(2, 64), replace(weight, scales=weight.scales.double()))
    with pytest.raises(KernelInputError, match="group_size 48 must divide 64"):
        emulated.quant_linear(torch.randn(2, 64), replace(weight, group_size=48))


def test_no_rows_gives_an_empty_result(emulated):
    weight = random_weight(8, 64, 4, 32, "sym", F16, "cpu", "empty")
    assert emulated.quant_linear(torch.randn(0, 64), weight).shape == (0, 8)


# ---- on a GPU: decode shapes of the 1B and 8B models ----
# The twin runs on the GPU too (plain torch); the weights are packed on the host, so the shapes stay below the
# largest projections (bench/kernels.py times those).

GPU_SHAPES = [  # n, k: Llama-3.2-1B fused qkv and down, Llama-3.1-8B fused qkv, an odd N
    (3072, 2048),
    (2048, 8192),
    (6144, 4096),
    (1001, 4096),
]
GPU_CONFIGS = [  # rows, bits, group, kind
    (1, 4, 128, "sym"),
    (1, 4, 32, "offsets"),
    (3, 4, 64, "zeros"),
    (8, 4, 128, "perm"),
    (1, 8, 128, "sym"),
    (5, 8, 32, "zeros"),
    (33, 4, 128, "zeros"),
]


def check_quant_linear_on_gpu(ops: CudaOps, dtype: torch.dtype, rows: int, n: int, k: int, bits, group, kind):
    weight = random_weight(n, k, bits, group, kind, F16, "cuda", (dtype, rows))
    x = torch.randn(rows, k, generator=_gen("quant-x-gpu", dtype, rows, n, k)).to(dtype).to("cuda")
    with poisoned_allocations():
        got = ops.quant_linear(x, weight)
    assert_matches(f"quant_linear {bits}-bit g{group} {kind} rows {rows}", got, quant_linear_twin(x, weight), dtype)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize(("n", "k"), GPU_SHAPES)
def test_quant_linear_gpu(on_gpu, dtype, n, k):
    for rows, bits, group, kind in GPU_CONFIGS:
        check_quant_linear_on_gpu(on_gpu, dtype, rows, n, k, bits, group, kind)


@pytest.mark.gpu
@requires_gpu
def test_quant_linear_fp16_activations_gpu(on_gpu):
    for rows, bits, group, kind in GPU_CONFIGS[:3]:
        check_quant_linear_on_gpu(on_gpu, F16, rows, 6144, 4096, bits, group, kind)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_dequantize_gpu_is_exact(on_gpu, dtype):
    for bits, group, kind in ((4, 128, "zeros"), (4, 32, "offsets"), (8, 128, "sym")):
        check_dequantize(on_gpu, "cuda", dtype, 4096, 4096, bits, group, kind)
