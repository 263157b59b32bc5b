"""DeviceQuantWeight: the one packed layout the GPU's weight-only kernels read (gpu/kernels/quant_gemv.cu).

Per projection of N outputs x K inputs, with G = K / group_size groups per row:
  qweight  int32 [N, K * bits / 32]: row n holds input columns 0..K-1 of output n; element j of a word sits at bits
           bits * j, lowest first (compressed-tensors' weight_packed order); values unsigned in [0, 2^bits).
  scales   fp16, bf16 or fp32 [N, G]; zeros: the same dtype [N, G] or None (then every zero is `zero`);
  offsets  the same dtype [N, G] or None (then 0).
  W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] + offset[n, g],  g = k // group_size.

Each format converts to it exactly (the kernels compute in fp32, where (q - zero) * scale is exact for these
values): GPTQ, AWQ and compressed-tensors keep their integer zero points and fp16/bf16 scales; GGUF Q4_0 is
zero 8 with the block's fp16 d; Q4_1 is zero 0, scale d and offset m; Q8_0 is an 8-bit group-32 weight with zero
128. Scales and offsets are kept in the narrowest float that holds every one of them exactly: fp16 or bf16 where
one does, else fp32. GGUF Q4_K needs fp32: its per-32 scale d * sc and min dmin * m are an fp16 (11 significant
bits) times a 6-bit integer, up to 17 significant bits, which bf16 (8) and fp16 (11) round but fp32 (24) holds;
so does bitsandbytes int8's per-row SCB / 127. Nothing is rounded on the way: what a 16-bit float cannot hold costs
two more bytes per group, never a different weight. (q - zero) * scale stays exact in the kernels' fp32 for every
16-bit scale and for Q4_K's 17-bit ones; a full 24-bit fp32 scale (SCB / 127) rounds that product once, as any fp32
dequantization of it (bitsandbytes' own included) does. bitsandbytes nf4 has no place here: its 16 levels are a
codebook, not evenly spaced, and the kernels compute (q - zero) * scale with no lookup table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraledger.errors import QuantizationError
from loraledger.quantization.packing import pack_int32

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # narrowest first: fp32 holds any fp32 value


def load_granule(bits: int) -> int:
    """Input columns in one 16-byte load of a row: a group must be a whole number of them."""
    return 128 // bits


@dataclass(frozen=True)
class DeviceQuantWeight:
    """A weight in the device layout (module docstring). perm: GPTQ desc_act's column order (x is gathered)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    offsets: torch.Tensor | None
    zero: float
    bits: int
    group_size: int
    out_features: int
    in_features: int
    perm: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> DeviceQuantWeight:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return DeviceQuantWeight(
            self.qweight.to(device),
            self.scales.to(device),
            move(self.zeros),
            move(self.offsets),
            self.zero,
            self.bits,
            self.group_size,
            self.out_features,
            self.in_features,
            move(self.perm),
        )

    def packed_bytes(self) -> int:
        """Bytes a GEMV must read: the packed values and every per-group tensor."""
        extra = sum(t.nbytes for t in (self.scales, self.zeros, self.offsets) if t is not None)
        return self.qweight.nbytes + extra

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] the kernels compute with, columns in q's order (the tests' reference)."""
        q = unpack_rows(self.qweight, self.bits).to(torch.float32)
        n, k = q.shape
        per = self.group_size
        zeros = torch.full_like(self.scales, self.zero) if self.zeros is None else self.zeros
        w = (q.reshape(n, k // per, per) - zeros.float()[..., None]) * self.scales.float()[..., None]
        if self.offsets is not None:
            w = w + self.offsets.float()[..., None]
        return w.reshape(n, k)


def layout_nbytes(
    n: int, k: int, bits: int, group_size: int, *, scale_bytes: int, zeros: bool, offsets: bool, perm: bool
) -> int:
    """DeviceQuantWeight.packed_bytes() (plus a desc_act perm's int64 [K]) of an [n, k] weight, from its shape alone:
    what the KV-cache budget counts for it before anything is loaded."""
    groups = n * (k // group_size)
    return n * k * bits // 8 + groups * scale_bytes * (1 + zeros + offsets) + (8 * k if perm else 0)


def unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The unsigned values [N, K] of a device qweight (int64 arithmetic: the words are signed int32)."""
    per = 32 // bits
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=qweight.device) * bits
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(qweight.shape[0], -1)


def _exact_scales(values: dict[str, torch.Tensor], prefer: torch.dtype | None) -> list[torch.Tensor]:
    """Each tensor (fp32) in one dtype of SCALE_DTYPES (`prefer` first, fp32 last), without rounding any of them."""
    order = [prefer] if prefer in SCALE_DTYPES[:2] else []
    order += [d for d in SCALE_DTYPES if d not in order]
    tensors = [v.to(torch.float32) for v in values.values()]
    for dtype in order:
        cast = [t.to(dtype) for t in tensors]
        if all(torch.equal(c.to(torch.float32), t) for c, t in zip(cast, tensors)):
            return [c.contiguous() for c in cast]
    raise QuantizationError(f"the {' and '.join(values)} hold NaN; the checkpoint is corrupt")


def _check(q: torch.Tensor, scale: torch.Tensor, bits: int) -> int:
    if bits not in (4, 8):
        raise QuantizationError(f"the GPU's packed layout holds 4- or 8-bit weights, not {bits}-bit")
    if q.dim() != 2 or scale.dim() != 2 or scale.shape[0] != q.shape[0] or q.shape[1] % scale.shape[1]:
        raise QuantizationError(f"scale {tuple(scale.shape)} does not fit a weight of {tuple(q.shape)}")
    group = q.shape[1] // scale.shape[1]
    if group % load_granule(bits):
        raise QuantizationError(
            f"group size {group} is not a multiple of {load_granule(bits)} ({bits}-bit values per 16-byte load); "
            "load this weight dequantized"
        )
    if int(q.min()) < 0 or int(q.max()) >= 2**bits:
        raise QuantizationError(f"quantized values outside [0, {2**bits}) for a {bits}-bit weight")
    return group


def from_zero_point(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    *,
    scale_dtype: torch.dtype | None = None,
    perm: torch.Tensor | None = None,
) -> DeviceQuantWeight:
    """W = (q - zero) * scale per group: compressed-tensors, GPTQ and AWQ as their readers in packing.py give them
    (q unsigned [N, K], scale and zero [N, G]). scale_dtype: the checkpoint's scale dtype, tried first."""
    group = _check(q, scale, bits)
    if zero.shape != scale.shape:
        raise QuantizationError(f"zero {tuple(zero.shape)} and scale {tuple(scale.shape)} differ in shape")
    zf = zero.to(torch.float32)
    if not torch.equal(zf, zf.round()) or int(zf.min()) < 0 or int(zf.max()) > 2**bits:
        raise QuantizationError(f"zero points must be integers in [0, {2**bits}] for a {bits}-bit weight")
    (scales,) = _exact_scales({"scales": scale}, scale_dtype)
    default = float(2 ** (bits - 1))
    zeros = None if bool((zf == default).all()) else zf.to(scales.dtype).contiguous()
    return DeviceQuantWeight(
        pack_int32(q, bits, dim=1).contiguous(), scales, zeros, None, default, bits, group, *q.shape, perm=perm
    )


def from_affine(
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: int,
    *,
    scale_dtype: torch.dtype | None = None,
    perm: torch.Tensor | None = None,
) -> DeviceQuantWeight:
    """W = q * scale + offset per group: GGUF blocks as gguf_blocks.decode gives them, or any format in that common
    form (offset = -zero * scale, exact in fp32). Offsets that are exact integer multiples of -scale become zero
    points (none stored when they are all the same, as Q4_0's 8 is); any other (Q4_1's m) is kept as an offset."""
    group = _check(q, scale, bits)
    if offset.shape != scale.shape:
        raise QuantizationError(f"offset {tuple(offset.shape)} and scale {tuple(scale.shape)} differ in shape")
    s, o = scale.to(torch.float32), offset.to(torch.float32)
    packed = pack_int32(q, bits, dim=1).contiguous()
    default = float(2 ** (bits - 1))
    nonzero = s != 0
    zero = (-o / torch.where(nonzero, s, 1.0)).round()
    # a group whose scale is 0 is its offset alone: any zero point fits it when that is 0, so take the others'
    fill = float(zero[nonzero][0]) if bool(nonzero.any()) else default
    zero = torch.where(nonzero, zero, fill)
    if torch.equal(-zero * s, o) and bool(((zero >= 0) & (zero <= 2**bits)).all()):
        (scales,) = _exact_scales({"scales": s}, scale_dtype)
        if bool((zero == fill).all()):
            return DeviceQuantWeight(packed, scales, None, None, fill, bits, group, *q.shape, perm=perm)
        zeros = zero.to(scales.dtype).contiguous()
        return DeviceQuantWeight(packed, scales, zeros, None, default, bits, group, *q.shape, perm=perm)
    scales, offsets = _exact_scales({"scales": s, "offsets": o}, scale_dtype)
    return DeviceQuantWeight(packed, scales, None, offsets, 0.0, bits, group, *q.shape, perm=perm)
