"""canonical_json / digest: one byte string per value."""

from __future__ import annotations

import datetime as dt
import hashlib
import math

import msgspec
import pytest

from loraledger.digests import canonical_json, digest, json_roundtrip


def test_sorted_compact_utf8():
    assert canonical_json({"b": 1, "a": [1, 2], "é": "ü"}) == '{"a":[1,2],"b":1,"é":"ü"}'.encode()


def test_floats_are_exact_and_distinct_from_ints():
    assert canonical_json([1.0, 1, 0.1, -0.0, 1e300, 2.5e-8]) == b"[1.0,1,0.1,-0.0,1e+300,2.5e-08]"
    x = 0.1 + 0.2
    assert json_roundtrip([x]) == [x]


def test_datetimes_are_iso_utc_with_microseconds():
    plus_two = dt.timezone(dt.timedelta(hours=2))
    assert canonical_json(dt.datetime(2026, 11, 22, 14, 0, 0, 5, tzinfo=plus_two)) == b'"2026-11-22T12:00:00.000005Z"'


@pytest.mark.parametrize("bad", [dt.datetime(2026, 1, 1), math.nan, math.inf, {1, 2}, b"x"])
def test_refuses_values_without_a_canonical_form(bad):
    with pytest.raises((ValueError, TypeError)):
        canonical_json({"v": bad})


def test_non_str_keys_encode_like_their_json_round_trip():
    value = {10: "ten", 2: "two", "x": {None: True}}
    assert canonical_json(value) == canonical_json(json_roundtrip(value)) == b'{"10":"ten","2":"two","x":{"null":true}}'
    with pytest.raises(ValueError, match="collide"):
        canonical_json({1: "a", "1": "b"})


def test_structs_encode_as_their_fields():
    class Point(msgspec.Struct):
        y: int
        x: dt.datetime

    at = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    assert canonical_json(Point(y=1, x=at)) == b'{"x":"2026-01-01T00:00:00.000000Z","y":1}'


def test_digest_is_sha256_of_canonical_json():
    assert digest({"b": 1, "a": 2}) == hashlib.sha256(b'{"a":2,"b":1}').hexdigest()
    assert digest({"a": 1}) != digest({"a": 1.0})
