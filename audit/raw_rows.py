"""Audit rows read without trusting them: each column decoded as its type would decode it, and checked.

`verify` reads rows that someone may have edited behind the guards' back: an `at` that is not a
time, a payload that is not JSON, a text `seq`, NULL in a JSON column. Selected through typed
columns, such a value raises inside the driver's result processing and takes the whole stream
down. Here the columns are selected untyped (the value as the driver returns it) and decoded one
by one with the column type's own processor, so a bad value is a finding about one row.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Boolean, Column, DateTime, Dialect, Double, Integer, String, Table, TypeDecorator, column
from sqlalchemy import table as sa_table
from sqlalchemy.sql.expression import ColumnElement, TableClause
from sqlalchemy.types import JSON

_BOOLEAN_RAW = (0, 1)  # what a Boolean column holds on SQLite (True and False compare equal to them)


def _processor(col: Column[Any], dialect: Dialect) -> Callable[[Any], Any] | None:
    """The column type's result processor on dialect (None where the driver's value needs none)."""
    try:
        return col.type.dialect_impl(dialect).result_processor(dialect, None)
    except (TypeError, LookupError, ValueError, AttributeError):
        # PostgreSQL's numeric processors want the column's type oid; psycopg already returns a float
        return None


def _python_check(col: Column[Any]) -> Callable[[Any], str | None]:
    """What a decoded value of col must be: returns why not, or None."""
    kind = col.type.impl if isinstance(col.type, TypeDecorator) else col.type

    def check(value: Any) -> str | None:
        if value is None:
            return None if col.nullable else "is NULL where a value is required"
        if isinstance(kind, JSON):
            return None  # any JSON value decodes; its shape is the caller's to check
        if isinstance(kind, Boolean):
            ok = isinstance(value, bool)
        elif isinstance(kind, Integer):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(kind, Double):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif isinstance(kind, String):
            ok = isinstance(value, str)
        elif isinstance(kind, DateTime):
            ok = isinstance(value, dt.datetime) and value.tzinfo is not None
        else:  # pragma: no cover - every audit column is one of the above
            ok = True
        return None if ok else f"holds {type(value).__name__} {_short(value)}, not {_expected(kind)}"

    return check


def _expected(kind: Any) -> str:
    if isinstance(kind, Boolean):
        return "a boolean"
    if isinstance(kind, Integer):
        return "an integer"
    if isinstance(kind, Double):
        return "a number"
    if isinstance(kind, String):
        return "text"
    return "a time"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class RawTable:
    """One audit table, selected untyped and decoded column by column."""

    def __init__(self, table: Table, dialect: Dialect):
        self.name = table.name
        self.table = table
        self.untyped: TableClause = sa_table(table.name, *(column(c.name) for c in table.c))
        self.c = self.untyped.c
        self._columns: list[tuple[str, Callable[[Any], Any] | None, Callable[[Any], str | None], bool]] = []
        for col in table.c:
            processor = _processor(col, dialect)
            is_bool = isinstance(col.type, Boolean) and dialect.name == "sqlite"
            self._columns.append((col.name, processor, _python_check(col), is_bool))

    def columns(self, prefix: str = "") -> list[ColumnElement[Any]]:
        """Every column, untyped, labelled prefix + name (for joins)."""
        return [self.untyped.c[name].label(prefix + name) for name, *_ in self._columns]

    def decode(self, mapping: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, str]]:
        """(column -> decoded value, column -> why it cannot be read) of one row's prefixed columns."""
        values: dict[str, Any] = {}
        bad: dict[str, str] = {}
        for name, processor, check, is_bool in self._columns:
            raw = mapping[prefix + name]
            if is_bool and raw is not None and (isinstance(raw, float) or raw not in _BOOLEAN_RAW):
                bad[name] = f"holds {_short(raw)}, not a boolean (0 or 1)"
                continue
            try:
                value = processor(raw) if processor is not None and raw is not None else raw
            except Exception as exc:  # noqa: BLE001 - any decoding failure is a finding about this row
                bad[name] = f"cannot be read ({type(exc).__name__}: {_short(str(exc))})"
                continue
            why = check(value)
            if why is not None:
                bad[name] = why
                continue
            values[name] = value
        return values, bad


def unix_times(values: Mapping[str, Any]) -> dict[str, Any]:
    """A decoded row with its times as unix seconds (as records and event payloads hold them)."""
    return {name: value.timestamp() if isinstance(value, dt.datetime) else value for name, value in values.items()}


def describe(bad: Mapping[str, str]) -> str:
    return "; ".join(f"column {name} {why}" for name, why in sorted(bad.items()))
