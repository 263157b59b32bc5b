"""Row files of a report bundle (CSV or JSONL): written and read back one row at a time, hashed while written."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loraledger.audit.results import ExportedFile
from loraledger.digests import FileDigest
from loraledger.errors import ConfigError

FORMATS = ("csv", "jsonl")
_CHUNK = 1 << 20
# A text cell starting with one of these is run as a formula by spreadsheets (OWASP: CSV injection);
# it is written with a single quote in front. A cell that starts with a quote already gets one too,
# so that reading back (csv_text) drops exactly one and every value comes back as it was.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "'")


def csv_cell(value: Any) -> Any:
    """value as a CSV cell a spreadsheet shows as text: a str that would start a formula gets a leading '."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def csv_text(cell: str) -> str:
    """The text a CSV cell written through csv_cell holds."""
    return cell[1:] if cell.startswith("'") else cell


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ConfigError(f"export format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


class _HashingSink(io.RawIOBase):
    """A binary file that hashes what goes through it, so a file's digest costs no second read."""

    def __init__(self, path: Path):
        self._file = open(path, "wb")
        self.sha256 = FileDigest()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        return self._file.write(view)

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


class RowWriter:
    """Writes rows with a fixed column list to one CSV (with a header row) or JSONL file.

    CSV cells are str, int, float or None (an empty cell); text that a spreadsheet would run as a
    formula is neutralised (csv_cell). JSON lines take any JSON value and keep it exact.
    """

    def __init__(self, path: Path, columns: Sequence[str], fmt: str):
        self.path = path
        self.columns = tuple(columns)
        self.fmt = check_format(fmt)
        self.rows = 0
        self._sink = _HashingSink(path)
        self._text = io.TextIOWrapper(io.BufferedWriter(self._sink, _CHUNK), encoding="utf-8", newline="")
        # CRLF line ends (RFC 4180): csv quotes a field holding a character of the line terminator, so a
        # bare \r inside a value is quoted too (with "\n" alone it was not, and split the row)
        self._csv = csv.writer(self._text, lineterminator="\r\n") if fmt == "csv" else None
        if self._csv is not None:
            self._csv.writerow(self.columns)

    def write(self, row: Sequence[Any]) -> None:
        if self._csv is not None:
            self._csv.writerow([csv_cell(value) for value in row])
        else:
            self._text.write(json.dumps(dict(zip(self.columns, row)), ensure_ascii=False, separators=(",", ":")))
            self._text.write("\n")
        self.rows += 1

    def close(self) -> ExportedFile:
        self._text.close()
        return ExportedFile(
            name=self.path.name, rows=self.rows, bytes=self._sink.size, sha256=self._sink.sha256.hexdigest()
        )

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._text.closed:
            self._text.close()


def read_rows(path: Path, fmt: str) -> Iterator[dict[str, Any]]:
    """The rows of a file RowWriter wrote, as column -> value; CSV cells come back as the text written
    (neutralised formulas restored), empty as None."""
    if check_format(fmt) == "csv":
        # a cell may be as long as anything the engine records (a long prompt or stop list): the file's size bounds it,
        # not the csv module's default of 128 KiB
        csv.field_size_limit(max(csv.field_size_limit(), path.stat().st_size))
        with open(path, encoding="utf-8", newline="") as file:
            reader = csv.reader(file)
            header = next(reader, None)
            if header is None:
                raise ValueError(f"{path.name} is empty: it has no header row")
            for line, cells in enumerate(reader, start=2):
                if len(cells) != len(header):
                    raise ValueError(f"{path.name} row {line} has {len(cells)} cells, the header has {len(header)}")
                yield {k: (csv_text(v) if v != "" else None) for k, v in zip(header, cells)}
    else:
        with open(path, encoding="utf-8") as file:
            for line, text in enumerate(file, start=1):
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path.name} line {line} is not JSON: {exc.msg}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path.name} line {line} is not a JSON object")
                yield row
