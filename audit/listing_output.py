"""How the audit listings are written: a fixed-width table, CSV or JSON lines, streamed as rows come, and every
caller-chosen text made safe for a terminal (shown)."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

from loraledger.audit.export import csv_cell


def emit(
    rows: Iterable[Any],
    table: Sequence[tuple[str, str, int]],
    fields: Sequence[str],
    fmt: str,
    out: TextIO,
    cells: Callable[[Any], dict[str, Any]],
) -> None:
    """Write rows as they stream in: a fixed-width table of (field, header, width), or CSV / JSON lines of fields."""
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\r\n")  # RFC 4180: a bare \r in a value is quoted too
        writer.writerow(fields)
        for row in rows:
            c = cells(row)
            writer.writerow([_csv_cell(c.get(name)) for name in fields])
    elif fmt == "jsonl":
        for row in rows:
            c = cells(row)
            out.write(
                json.dumps({name: c.get(name) for name in fields}, ensure_ascii=False, separators=(",", ":")) + "\n"
            )
    else:
        widths = [max(width, len(header)) for _, header, width in table]
        out.write(" ".join(h.ljust(w) for (_, h, _), w in zip(table, widths)).rstrip() + "\n")
        n = 0
        for row in rows:
            c = cells(row)
            out.write(
                " ".join(_fit(name, _text(name, c.get(name)), w) for (name, _, _), w in zip(table, widths)).rstrip()
                + "\n"
            )
            n += 1
        out.write(f"({n} row{'s' if n != 1 else ''})\n")


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        value = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return csv_cell(value)  # no cell a spreadsheet would run as a formula


def shown(text: str) -> str:
    """text for a terminal: every character that is not printable (control characters, ANSI escapes, C1 controls,
    line and paragraph separators, ...) written as its Python escape, so a name chosen by a caller can neither
    forge lines nor drive the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _text(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) and name.endswith(("_at", "_used")) and len(value) > 19:
        return value[:10] + " " + value[11:19] + "Z"
    if isinstance(value, float):
        return f"{value:g}"
    return shown(str(value))


WHOLE = frozenset({"request_id"})  # never cut: `audit show` takes what the listing prints


def _fit(name: str, text: str, width: int) -> str:
    if len(text) <= width or name in WHOLE:
        return text.ljust(width)
    return text[: width - 1] + "…"
