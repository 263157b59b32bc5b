"""A minimal PNG reader for screenshot checks (8-bit RGB / RGBA, not interlaced), with zlib and struct only."""

from __future__ import annotations

import struct
import zlib
from itertools import accumulate

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _add_bytes(a: bytes, b: bytes) -> bytes:
    """Bytewise (a + b) mod 256 over whole rows at once: big-integer SWAR, no per-byte loop."""
    n = len(a)
    x, y = int.from_bytes(a, "big"), int.from_bytes(b, "big")
    low, high = int.from_bytes(b"\x7f" * n, "big"), int.from_bytes(b"\x80" * n, "big")
    return (((x & low) + (y & low)) ^ ((x ^ y) & high)).to_bytes(n, "big")


def _unfilter(kind: int, line: bytes, prev: bytes, bpp: int) -> bytes:
    if kind == 0:
        return line
    if kind == 2:
        return _add_bytes(line, prev)
    if kind == 1:
        out = bytearray(len(line))
        for c in range(bpp):
            out[c::bpp] = bytes(accumulate(line[c::bpp], lambda s, v: (s + v) & 0xFF))
        return bytes(out)
    out = bytearray(line)
    for i in range(len(out)):
        left = out[i - bpp] if i >= bpp else 0
        up = prev[i]
        if kind == 3:
            out[i] = (out[i] + ((left + up) >> 1)) & 0xFF
            continue
        up_left = prev[i - bpp] if i >= bpp else 0
        p = left + up - up_left
        pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
        pred = left if pa <= pb and pa <= pc else (up if pb <= pc else up_left)
        out[i] = (out[i] + pred) & 0xFF
    return bytes(out)


def read_png(data: bytes) -> tuple[int, int, int, list[bytes]]:
    """(width, height, bytes per pixel, rows of raw pixel bytes)."""
    if not data.startswith(_SIGNATURE):
        raise ValueError("not a PNG file")
    pos, idat = len(_SIGNATURE), []
    width = height = bpp = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or color not in (2, 6) or interlace:
                raise ValueError(f"unsupported PNG: depth {depth}, color type {color}, interlace {interlace}")
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    rows, prev = [], bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        prev = _unfilter(raw[start], raw[start + 1 : start + 1 + stride], prev, bpp)
        rows.append(prev)
    return width, height, bpp, rows


def distinct_colors(data: bytes) -> int:
    _, _, bpp, rows = read_png(data)
    colors: set[bytes] = set()
    for row in rows:
        colors.update(row[i : i + 3] for i in range(0, len(row), bpp))
    return len(colors)
