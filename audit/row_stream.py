"""RowStream: a cursor's rows consumed in step with another walk (per request, per event), one look-ahead row held."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import Row


class RowStream:
    """Rows read in order, handed out in runs: take_while(pred) yields rows while pred holds for the next one.

    Both verify and the per-request listings walk a second cursor (completions) in step with the first
    (events, requests): memory stays one row, whatever the row counts."""

    def __init__(self, rows: Iterator[Row[Any]]) -> None:
        self._rows = rows
        self._next: Row[Any] | None = None
        self._started = False

    def peek(self) -> Row[Any] | None:
        if not self._started:
            self._started = True
            self._next = next(self._rows, None)
        return self._next

    def take_while(self, pred: Callable[[Row[Any]], bool]) -> Iterator[Row[Any]]:
        while (row := self.peek()) is not None and pred(row):
            self._next = next(self._rows, None)
            yield row

    def close(self) -> None:
        close = getattr(self._rows, "close", None)
        if close is not None:
            close()
