"""Packed low-bit layouts, written from each format's documentation.

compressed-tensors pack-quantized: weight_packed int32 [out, in * bits / 32]; the signed value q (range
[-2^(bits-1), 2^(bits-1))) is stored as q + 2^(bits-1), packed along the input dim, element j of a word at bits
j*bits (lowest first). weight_scale [out, groups] (groups = 1 per channel). weight_zero_point (asymmetric only):
int32 [out * bits / 32, groups], the zero points stored as zero + 2^(bits-1) and packed the same way along the output
dim (compressed-tensors' pack_to_int32(zero_point, bits, packed_dim=0), what llmcompressor writes); an older,
unpacked form, int8 [out, groups] holding the signed zero point, is read too. Dequantized weight:
(q - zero_point) * scale.

GPTQ (checkpoint_format "gptq"): qweight int32 [in * bits / 32, out] packed along the input dim, lowest bits first;
qzeros int32 [groups, out * bits / 32] packed along the output dim, stored as zero - 1; scales [groups, out];
g_idx [in] the group of each input column. Dequantized weight[n, k]: (q[k, n] - (qzeros[g, n] + 1)) * scales[g, n]
with g = g_idx[k].

AWQ (GEMM layout): qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], both packed along the output
dim with the nibble order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i holds output column 8 * word + order[i]); scales
[groups, out]. Dequantized weight[n, k]: (q[k, n] - zeros[g, n]) * scales[g, n] with g = k // group_size.
"""

from __future__ import annotations

import torch

from loraledger.errors import QuantizationError


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values (0 <= v < 2^bits) packed 32 // bits to an int32 word along dim, lowest bits first."""
    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % per_word:
        raise QuantizationError(f"a packed dim of {v.shape[-1]} is not a multiple of {per_word} ({bits}-bit values)")
    v = v.reshape(*v.shape[:-1], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (v << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim)


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of pack_int32: unsigned values as int32, the packed dim 32 // bits times longer."""
    per_word = 32 // bits
    w = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    values = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*w.shape[:-1], -1).to(torch.int32).movedim(-1, dim)


def _expand_groups(per_group: torch.Tensor, in_features: int) -> torch.Tensor:
    groups = per_group.shape[1]
    if in_features % groups:
        raise QuantizationError(f"{groups} quantization groups do not divide {in_features} input columns")
    return per_group.repeat_interleave(in_features // groups, dim=1)


def compressed_tensors_unpack(
    packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q unsigned int32 [out, in], scale fp32 [out, groups], zero unsigned fp32 [out, groups]) of a pack-quantized
    weight; the dequantized weight is (q - zero) * scale per group."""
    q = unpack_int32(packed, bits, dim=1)
    if q.shape[1] != in_features:
        raise QuantizationError(f"weight_packed unpacks to {q.shape[1]} input columns, config says {in_features}")
    scale = scale.to(torch.float32).reshape(q.shape[0], -1)
    offset = 2 ** (bits - 1)
    if zero_point is None:
        zero = torch.full_like(scale, float(offset))
    elif zero_point.dtype == torch.int32:  # packed along the output dim, stored unsigned
        rows = -(-q.shape[0] * bits // 32)
        if tuple(zero_point.shape) != (rows, scale.shape[1]):
            raise QuantizationError(
                f"weight_zero_point {tuple(zero_point.shape)} is not the packed zero points of a "
                f"[{q.shape[0]}, {in_features}] weight in {scale.shape[1]} groups (expected ({rows}, {scale.shape[1]}))"
            )
        zero = unpack_int32(zero_point, bits, dim=0)[: q.shape[0]].to(torch.float32)
    else:
        zero = zero_point.to(torch.float32).reshape(scale.shape) + offset
    return q, scale, zero


def compressed_tensors_pack(
    weight: torch.Tensor, bits: int, group_size: int | None, symmetric: bool
) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantization of a float weight [out, in] into pack-quantized tensors (the tests' fixtures)."""
    out, k = weight.shape
    g = group_size or k
    w = weight.to(torch.float32).reshape(out, k // g, g)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if symmetric:
        scale = (w.abs().amax(-1) / ((hi - lo) / 2)).clamp(min=1e-8)
        zero = torch.zeros_like(scale)
    else:
        wmin, wmax = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((wmax - wmin) / (hi - lo)).clamp(min=1e-8)
        zero = (lo - torch.round(wmin / scale)).clamp(lo, hi)
    q = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], lo, hi).reshape(out, k)
    tensors = {"weight_packed": pack_int32(q + 2 ** (bits - 1), bits, dim=1), "weight_scale": scale.to(torch.float16)}
    if not symmetric:
        tensors["weight_zero_point"] = pack_int32_padded(zero + 2 ** (bits - 1), bits, dim=0)
    return tensors


def pack_int32_padded(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """pack_int32 with the packed dim padded with zeros to a whole word (compressed-tensors' zero points)."""
    per_word = 32 // bits
    pad = -values.shape[dim] % per_word
    if pad:
        shape = list(values.shape)
        shape[dim] = pad
        values = torch.cat([values, torch.zeros(shape, dtype=values.dtype)], dim=dim)
    return pack_int32(values, bits, dim)


def gptq_unpack(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int | None,
) -> torch.Tensor:
    """The dequantized fp32 weight [out, in] of a GPTQ layer (g_idx honoured, so desc_act checkpoints work)."""
    q = unpack_int32(qweight, bits, dim=0)  # [in, out]
    k, n = q.shape
    zeros = unpack_int32(qzeros, bits, dim=1)[:, :n] + 1  # [groups, out]
    if g_idx is None:
        g = group_size or k
        g_idx = torch.arange(k) // g
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (k,) or int(g_idx.max()) >= scales.shape[0]:
        raise QuantizationError(f"g_idx of shape {tuple(g_idx.shape)} does not index {scales.shape[0]} groups")
    w = (q - zeros[g_idx]).to(torch.float32) * scales.to(torch.float32)[g_idx]
    return w.t().contiguous()


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    nibbles = unpack_int32(words, 4, dim=1)  # [rows, out] in nibble order within each word
    rows, out = nibbles.shape
    columns = torch.empty_like(nibbles).reshape(rows, -1, 8)
    columns[..., list(AWQ_ORDER)] = nibbles.reshape(rows, -1, 8)
    return columns.reshape(rows, out)


def awq_unpack(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q unsigned int32 [out, in], scale fp32 [out, groups], zero fp32 [out, groups]) of an AWQ GEMM layer, ready
    for QuantizedLinear (its 4-bit groups run on torch's int4 kernel)."""
    q = _awq_columns(qweight).t().contiguous()
    zeros = _awq_columns(qzeros).to(torch.float32)
    if zeros.shape != scales.shape or q.shape[0] != scales.shape[1] or q.shape[1] % scales.shape[0]:
        raise QuantizationError(
            f"AWQ qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales {tuple(scales.shape)} "
            "do not describe one layer"
        )
    return q, scales.to(torch.float32).t().contiguous(), zeros.t().contiguous()


def gptq_grouped(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q unsigned int32 [out, in], scale [out, groups], zero [out, groups], perm) of a GPTQ layer for QuantizedLinear.

    With desc_act the columns of one group are scattered; perm (None when they are already in order) sorts them by
    group, so that x[:, perm] @ W[:, perm].T, which equals x @ W.T, runs on contiguous groups."""
    q = unpack_int32(qweight, bits, dim=0).t().contiguous()  # [out, in]
    n, k = q.shape
    zeros = (unpack_int32(qzeros, bits, dim=1)[:, :n] + 1).to(torch.float32)
    groups = scales.shape[0]
    if k % groups or zeros.shape != scales.shape:
        raise QuantizationError(f"GPTQ scales {tuple(scales.shape)} do not describe a [{n}, {k}] weight's groups")
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (k,) or bool((torch.bincount(g_idx, minlength=groups) != k // groups).any()):
            raise QuantizationError(f"g_idx does not put {k // groups} columns in each of {groups} groups")
        order = torch.argsort(g_idx, stable=True)
        if not torch.equal(order, torch.arange(k)):
            perm, q = order, q[:, order].contiguous()
    return q, scales.to(torch.float32).t().contiguous(), zeros.t().contiguous(), perm
