"""The safetensors format as an adapter load reads it: the header's tensor entries, checked, then their bytes.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range in the data section, then the data section. The header is read and checked against
the file's size first, so no tensor byte is read for a file whose header does not hold together.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import torch

from loraledger.errors import AdapterFormatError, AdapterNotFoundError
from loraledger.lora.adapter_errors import AdapterErrors
from loraledger.lora.adapter_files import WEIGHTS_FILE

# safetensors dtype string -> (torch dtype, bytes per element); others are refused on load
DTYPES = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
}
MAX_HEADER_BYTES = 16 << 20  # ~100,000 tensors' entries: far above any LoRA (the safetensors library allows 100 MB)


@dataclass(frozen=True)
class RawTensor:
    """One tensor as the file holds it: its header entry, and its bytes once read_tensors has read them."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte range in the data section (after the header)
    end: int
    data: bytearray | None = None  # the bytes as stored, once read (read_tensors)


def corrupt(err: AdapterErrors, why: str) -> Exception:
    return err(
        AdapterFormatError, f"{WEIGHTS_FILE} is corrupt or truncated ({why}); re-save or re-download the adapter"
    )


def read_header(f, err: AdapterErrors) -> list[RawTensor]:
    """The tensors the safetensors header declares, sorted by name, without their bytes.

    Reads the 8-byte header length and the header only. Refuses a header longer than the file or than
    MAX_HEADER_BYTES, a malformed entry, and a data section that is not exactly its tensors' bytes
    (the format allows no holes and nothing after the last tensor), so the file's size is checked
    against the header here, before any tensor byte is read.
    """
    try:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
    except OSError as exc:
        raise err(AdapterNotFoundError, f"cannot read {WEIGHTS_FILE}: {exc}; check the folder's permissions") from exc
    if len(head) < 8:
        raise corrupt(err, f"{size} bytes, shorter than the 8-byte header length")
    header_len = int.from_bytes(head, "little")
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise corrupt(err, f"header length {header_len} does not fit the {size}-byte file")
    try:
        header = json.loads(f.read(header_len).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise corrupt(err, f"header is not JSON: {exc}") from exc
    except OSError as exc:
        raise err(AdapterNotFoundError, f"cannot read {WEIGHTS_FILE}: {exc}; check the folder's permissions") from exc
    if not isinstance(header, dict):
        raise corrupt(err, "header is not a JSON object")
    data_len = size - 8 - header_len
    tensors = [_entry(name, header[name], data_len, err) for name in sorted(header) if name != "__metadata__"]
    _check_data_section(tensors, data_len, size, header_len, err)
    return tensors


def _entry(name: str, entry: object, data_len: int, err: AdapterErrors) -> RawTensor:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        ok = (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and type(begin) is int
            and type(end) is int
        )
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise corrupt(err, f"malformed header entry for {name!r}")
    if not 0 <= begin <= end <= data_len:
        raise corrupt(err, f"tensor {name!r} spans bytes {begin}..{end} of a {data_len}-byte data section")
    return RawTensor(name, dtype, tuple(shape), begin, end)


def _check_data_section(
    tensors: list[RawTensor], data_len: int, size: int, header_len: int, err: AdapterErrors
) -> None:
    covered = 0
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if t.begin != covered:
            raise corrupt(
                err,
                f"the data section has bytes {covered}..{t.begin} that belong to no tensor (or tensors that overlap)",
            )
        covered = t.end
    if covered != data_len:
        raise corrupt(
            err,
            f"the data section has {data_len - covered} bytes after the last tensor (the file is {size} bytes, its tensors end at byte {8 + header_len + covered})",
        )


def read_tensors(f, tensors: list[RawTensor], err: AdapterErrors) -> list[RawTensor]:
    """`tensors` with their bytes, each read once from the open file (the header's size checks came first)."""
    data_start = f.tell()
    out = []
    for t in tensors:
        buf = bytearray(t.end - t.begin)
        try:
            f.seek(data_start + t.begin)
            got = f.readinto(buf)
        except OSError as exc:
            raise err(
                AdapterNotFoundError, f"cannot read {WEIGHTS_FILE}: {exc}; check the folder's permissions"
            ) from exc
        if got != len(buf):
            raise corrupt(err, f"tensor {t.name!r}: the file ended after {got} of its {len(buf)} bytes")
        out.append(dataclasses.replace(t, data=buf))
    return out


def check_dtype_and_size(t: RawTensor, nbytes: int, err: AdapterErrors) -> None:
    """The tensor's dtype is one we read, and its shape needs exactly `nbytes` bytes of it."""
    if t.dtype not in DTYPES:
        raise err(
            AdapterFormatError, f"tensor {t.name!r} has dtype {t.dtype}; only F32, F16, BF16 and F64 are supported"
        )
    numel = math.prod(t.shape)
    if numel * DTYPES[t.dtype][1] != nbytes:
        raise err(
            AdapterFormatError,
            f"tensor {t.name!r}: shape {list(t.shape)} of {t.dtype} needs {numel * DTYPES[t.dtype][1]} bytes, "
            f"the file holds {nbytes}; the file is corrupt, re-save the adapter",
        )


def to_fp32(t: RawTensor, err: AdapterErrors) -> torch.Tensor:
    """A read tensor as an fp32 CPU tensor that owns its memory."""
    check_dtype_and_size(t, len(t.data), err)
    dtype = DTYPES[t.dtype][0]
    if not t.data:
        return torch.zeros(t.shape, dtype=torch.float32)
    # the buffer is our own (aligned, writable) bytearray, so frombuffer is safe; .to() makes the fp32 tensor own its memory
    flat = torch.frombuffer(t.data, dtype=dtype)
    return flat.to(torch.float32, copy=True).reshape(t.shape).contiguous()
