"""stored_time: the store's microsecond rounding, which every digest over a stored time takes first."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from loraledger.digests import stored_datetime, stored_time

# unix seconds from 2^13 (DIGESTS.md: where the float product is exact) to 2^33 (the year 2242)
times = st.floats(min_value=2.0**13, max_value=2.0**33, allow_nan=False, allow_infinity=False)


@settings(max_examples=2000, deadline=None)
@given(times)
def test_the_exact_half_even_microsecond(t):
    us = int((Decimal(t) * 10**6).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))
    assert stored_time(t) == us / 10**6
    assert stored_datetime(t).microsecond == us % 10**6


@settings(max_examples=2000, deadline=None)
@given(times)
def test_storing_twice_changes_nothing_and_agrees_with_decimal_rounding(t):
    once = stored_time(t)
    assert stored_time(once) == once
    assert once == round(t, 6)  # decimal rounding to 6 places gives the same value in this range


def test_none_stays_none():
    assert stored_time(None) is None
