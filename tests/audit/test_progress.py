"""Progress: a redrawn bar on a terminal, one plain line otherwise, nothing when disabled."""

from __future__ import annotations

import io

from loraledger.audit.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar():
    out = _Tty()
    with Progress("exporting", 4, stream=out) as bar:
        for _ in range(4):
            bar.advance()
    text = out.getvalue()
    assert "\r" in text and "[##############################] 100.0% 4/4" in text and text.endswith("\n")


def test_a_pipe_gets_one_plain_line():
    out = io.StringIO()
    with Progress("exporting", 4, stream=out) as bar:
        bar.advance(4)
    assert out.getvalue().startswith("exporting: 4 rows in ") and "\r" not in out.getvalue()


def test_disabled_progress_is_silent():
    out = _Tty()
    with Progress("exporting", 4, stream=out, enabled=False) as bar:
        bar.advance(4)
    assert out.getvalue() == ""
