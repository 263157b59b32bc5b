"""Canonical JSON: one byte string per value, so that digests and the event hash chain are reproducible."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from typing import Any

import msgspec


def _key(key: Any) -> str:
    # the same spelling json.dumps gives non-str keys, so a value and its JSON round trip agree
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    raise TypeError(f"dict key {key!r} ({type(key).__name__}) has no canonical JSON form")


_CONTAINERS = (dict, list, tuple, msgspec.Struct)


def _plain(value: Any) -> Any:
    """value with every dict key a str and every Struct a dict, ready for sort_keys."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value, builtin_types=(dt.datetime,))
    if isinstance(value, dict):
        out = {_key(k): _plain(v) for k, v in value.items()}
        if len(out) != len(value):
            raise ValueError(f"dict keys collide once written as JSON strings: {sorted(map(repr, value))}")
        return out
    if isinstance(value, (list, tuple)):
        if not any(isinstance(v, _CONTAINERS) for v in value):
            return value  # the common flat list (token ids, stop strings): nothing to rewrite
        return [_plain(v) for v in value]
    return value


def _encode_extra(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value, builtin_types=(dt.datetime,))
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r} cannot be encoded canonically: attach a timezone")
        return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    # sets have no canonical order and bytes no JSON form: the caller must choose one
    raise TypeError(f"{type(value).__name__} has no canonical JSON form; convert it to a list, str or dict first")


def canonical_json(obj: Any) -> bytes:
    """UTF-8 JSON with sorted keys and no whitespace.

    Floats are written as their shortest exact repr (1.0 stays 1.0, distinct from 1); aware
    datetimes as ISO-8601 UTC with microseconds (`2026-11-22T12:00:00.000000Z`); msgspec Structs
    as their fields; non-str dict keys as json.dumps spells them (so canonical_json(x) ==
    canonical_json(json_roundtrip(x))). NaN, infinities, naive datetimes, sets and bytes are
    refused with ValueError / TypeError.
    """
    text = json.dumps(
        _plain(obj),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
        default=_encode_extra,
    )
    return text.encode("utf-8")


def digest(obj: Any) -> str:
    """sha256 hex of canonical_json(obj)."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def json_roundtrip(obj: Any) -> Any:
    """obj as a JSON column reads it back: keys as str, tuples as lists, datetimes as ISO strings.

    The store keeps JSON values in this form, so that what it hashed and compared before a
    write is exactly what a later reader (and the chain verifier) sees.
    """
    # no key sorting needed here: only the values matter, and json.dumps already writes keys as str
    return json.loads(json.dumps(obj, ensure_ascii=False, allow_nan=False, default=_encode_extra))
