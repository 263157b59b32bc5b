"""Progress of long exports: a redrawn bar when stderr is a terminal, a few plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_REDRAW_SECONDS = 0.1
_BAR_WIDTH = 30


class Progress:
    """Counts work units of one named phase; cheap to call per row (redraws are rate-limited)."""

    def __init__(self, label: str, total: int | None, *, stream: TextIO | None = None, enabled: bool = True):
        self.label = label
        self.total = total
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._tty = enabled and _isatty(self._stream)
        self._started = time.monotonic()
        self._last_draw = 0.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._tty:
            now = time.monotonic()
            if now - self._last_draw >= _REDRAW_SECONDS:
                self._last_draw = now
                self._draw()

    def finish(self) -> None:
        if not self._enabled:
            return
        elapsed = time.monotonic() - self._started
        if self._tty:
            self._draw()
            self._stream.write("\n")
        else:
            self._stream.write(f"{self.label}: {self.done} rows in {elapsed:.1f} s\n")
        self._stream.flush()

    def _draw(self) -> None:
        if self.total:
            frac = min(1.0, self.done / self.total)
            filled = int(frac * _BAR_WIDTH)
            bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
            text = f"\r{self.label} [{bar}] {frac:6.1%} {self.done}/{self.total}"
        else:
            text = f"\r{self.label} {self.done}"
        self._stream.write(text)
        self._stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.finish()
        elif self._tty:
            self._stream.write("\n")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
