"""Instants for audit filters and exports: ISO-8601 text or datetimes in, unix seconds (UTC) out."""

from __future__ import annotations

import datetime as dt

from loraledger.errors import ConfigError

Instant = float | int | str | dt.datetime | dt.date | None


def to_unix(value: Instant, *, what: str = "time") -> float | None:
    """Unix seconds for a filter bound; naive datetimes and ISO text without an offset are UTC."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be an ISO-8601 time, a datetime or unix seconds, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        value = _parse_iso(value, what=what)
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        return value.timestamp()
    if isinstance(value, dt.date):
        return dt.datetime(value.year, value.month, value.day, tzinfo=dt.timezone.utc).timestamp()
    raise ConfigError(f"{what} must be an ISO-8601 time, a datetime or unix seconds, got {value!r}")


def _parse_iso(text: str, *, what: str) -> dt.datetime | dt.date:
    raw = text.strip()
    if raw.endswith(("Z", "z")):
        raw = raw[:-1] + "+00:00"
    try:
        if len(raw) == 10:
            return dt.date.fromisoformat(raw)
        return dt.datetime.fromisoformat(raw)
    except ValueError:
        raise ConfigError(
            f"{what} {text!r} is not an ISO-8601 time; use e.g. 2026-11-22 or 2026-11-22T13:45:00Z"
        ) from None


def iso(unix: float | None) -> str | None:
    """UTC ISO-8601 text with microseconds, the form every export uses."""
    if unix is None:
        return None
    return dt.datetime.fromtimestamp(unix, tz=dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
