"""A second implementation of the digests, written from DIGESTS.md alone, the way a third party would.

It imports nothing from loraledger (test_spec_vectors checks that), and spells out what DIGESTS.md says
by hand where the engine leans on a library: the string escapes, the float layout, the shortest digits,
the microsecond rounding.
"""

from __future__ import annotations

import hashlib
import math
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _string(text: str, *, ascii_only: bool = False) -> str:
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif code < 0x20:
            out.append(f"\\u{code:04x}")
        elif ascii_only and code > 0x7F:
            if code > 0xFFFF:  # UTF-16 surrogate pair
                code -= 0x10000
                out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
            else:
                out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _shortest_digits(x: float) -> tuple[str, int]:
    """The shortest digit string that reads back as x (x > 0), and the decimal exponent of its first digit."""
    for precision in range(1, 18):
        text = f"{x:.{precision - 1}e}"  # correctly rounded: the nearest decimal with this many digits
        if float(text) == x:
            break
    mantissa, exponent = text.split("e")
    return mantissa.replace(".", "").rstrip("0") or "0", int(exponent)


def float_text(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        raise ValueError("NaN and infinities have no canonical form")
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    sign = "-" if x < 0 else ""
    digits, e = _shortest_digits(abs(x))
    if -4 <= e < 16:
        if e >= 0:
            whole, frac = digits[: e + 1].ljust(e + 1, "0"), digits[e + 1 :] or "0"
        else:
            whole, frac = "0", "0" * (-e - 1) + digits
        return f"{sign}{whole}.{frac}"
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{sign}{mantissa}e{'+' if e >= 0 else '-'}{abs(e):02d}"


def cj_text(value: Any, *, ascii_only: bool = False) -> str:
    """Section 1 (ascii_only: the base model config's form, section 7)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return float_text(value)
    if isinstance(value, str):
        return _string(value, ascii_only=ascii_only)
    if isinstance(value, list):
        return "[" + ",".join(cj_text(v, ascii_only=ascii_only) for v in value) + "]"
    if isinstance(value, dict):
        members = sorted(value.items())  # str order is code point order
        return (
            "{"
            + ",".join(f"{_string(k, ascii_only=ascii_only)}:{cj_text(v, ascii_only=ascii_only)}" for k, v in members)
            + "}"
        )
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def cj(value: Any) -> bytes:
    return cj_text(value).encode("utf-8")


def digest(value: Any) -> str:
    return sha256(cj(value))


def stored_microseconds(t: float) -> int:
    """Section 2: round half even on the exact value of the double."""
    return int((Decimal(t) * 10**6).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))


def stored_time(t: float | None) -> float | None:
    return None if t is None else stored_microseconds(t) / 10**6  # int / int: the nearest double


def event_hash(prev_hash: str, event: dict[str, Any]) -> str:
    """Section 3; event holds seq, at (its canonical text), kind, request_id, payload, dedup_key, instance_id."""
    fields = [event[k] for k in ("seq", "at", "kind", "request_id", "payload", "dedup_key")]
    if event.get("instance_id") is not None:
        fields.append(event["instance_id"])
    return sha256(prev_hash.encode("ascii") + cj(fields))


_SALTED = ("text_commitment", "token_ids_commitment")


def _completion_form(c: dict[str, Any]) -> dict[str, Any]:
    """Section 4: form v1 (no text_commitment) without the commitments, form v2 without text and token_ids; form v3
    with tool_calls_commitment (and no tool_calls); tool_calls and tool_calls_commitment only where not null."""
    out = {**c, "first_token_at": stored_time(c["first_token_at"]), "finished_at": stored_time(c["finished_at"])}
    drop = _SALTED if c.get("text_commitment") is None else ("text", "token_ids")
    return {
        k: v
        for k, v in out.items()
        if k not in drop and not (k in ("tool_calls", "tool_calls_commitment") and v is None)
    }


def completions_sha256(completions: list[dict[str, Any]]) -> str:
    """Section 4: in index order, times as stored."""
    return digest([_completion_form(c) for c in sorted(completions, key=lambda c: c["index"])])


def text_commitment(salt: str, text: str) -> str:
    """Section 4: sha256 of the 16 salt bytes, then the text's UTF-8."""
    return sha256(bytes.fromhex(salt) + text.encode("utf-8"))


def token_ids_commitment(salt: str, token_ids: list[int]) -> str:
    """Section 4: sha256 of the 16 salt bytes, then the canonical JSON of the ids."""
    return sha256(bytes.fromhex(salt) + cj(token_ids))


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def adapter_fingerprint(config: dict[str, Any], tensors: list[tuple[str, str, list[int], bytes]]) -> str:
    """Section 6; tensors as (name, dtype, shape, bytes)."""
    stream = _frame(b"loraledger-adapter-fingerprint/v1") + _frame(cj(config))
    for name, dtype, shape, data in sorted(tensors, key=lambda t: t[0]):
        stream += _frame(name.encode("utf-8")) + _frame(dtype.encode("ascii"))
        stream += _frame(cj_text(shape).encode("ascii")) + _frame(data)
    return sha256(stream)


def base_model_fingerprint(config: dict[str, Any], files: list[tuple[str, bytes]]) -> str:
    """Section 7; files as (file name, bytes)."""
    stream = cj_text(config, ascii_only=True).encode("ascii")
    for name, data in sorted(files, key=lambda f: f[0]):
        stream += b"\0" + name.encode("utf-8") + b"\0" + data
    return sha256(stream)


def report_signed_message(manifest: dict[str, Any]) -> bytes:
    """Section 8."""
    return cj({k: v for k, v in manifest.items() if k != "signature"})
