"""Filter instants: ISO text, dates, datetimes and unix seconds, all UTC unless they say otherwise."""

from __future__ import annotations

import datetime as dt

import pytest

from loraledger.audit.timefmt import iso, to_unix
from loraledger.errors import ConfigError

MIDNIGHT = 1_795_305_600.0  # 2026-11-22T00:00:00Z


@pytest.mark.parametrize(
    "value",
    ["2026-11-22", "2026-11-22T00:00:00Z", "2026-11-22T01:00:00+01:00", "2026-11-22 00:00:00",
     dt.date(2026, 11, 22), dt.datetime(2026, 11, 22), MIDNIGHT, int(MIDNIGHT)],
)  # fmt: skip
def test_instants_convert_to_unix_seconds(value):
    assert to_unix(value) == MIDNIGHT


def test_iso_is_utc_with_microseconds():
    assert iso(MIDNIGHT + 0.5) == "2026-11-22T00:00:00.500000Z"
    assert iso(None) is None and to_unix(None) is None


@pytest.mark.parametrize("value", ["yesterday", "2026-13-01", True, object()])
def test_bad_instants_name_the_expected_form(value):
    with pytest.raises(ConfigError, match="ISO-8601"):
        to_unix(value, what="since")
