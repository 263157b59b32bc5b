"""Row files: CSV and JSONL written with a running digest, read back row by row."""

from __future__ import annotations

import csv
import json

import pytest

from loraledger.audit.export import RowWriter, check_format, csv_cell, csv_text, read_rows
from loraledger.digests import file_sha256
from loraledger.errors import ConfigError

ROWS = [
    ("r1", 3, 'line one\nline two, with "quotes"', None, 1.5),
    ("r2", 0, "", "x", -0.25),
]


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_rows_round_trip_and_the_digest_is_the_file_digest(tmp_path, fmt):
    path = tmp_path / f"rows.{fmt}"
    with RowWriter(path, ("id", "n", "text", "maybe", "f"), fmt) as writer:
        for row in ROWS:
            writer.write(row)
        entry = writer.close()
    assert entry.rows == 2 and entry.bytes == path.stat().st_size
    assert entry.sha256 == file_sha256(path)
    back = list(read_rows(path, fmt))
    assert [r["id"] for r in back] == ["r1", "r2"]
    assert back[0]["text"] == ROWS[0][2]
    assert back[0]["maybe"] is None
    assert back[1]["text"] in ("", None)  # CSV cannot tell an empty string from no value
    assert float(back[1]["f"]) == -0.25 and int(back[0]["n"]) == 3


def test_malformed_files_are_reported(tmp_path):
    (tmp_path / "a.csv").write_text("id,n\nr1\n")
    with pytest.raises(ValueError, match="row 2 has 1 cells"):
        list(read_rows(tmp_path / "a.csv", "csv"))
    (tmp_path / "a.jsonl").write_text('{"id": 1}\n[1]\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON object"):
        list(read_rows(tmp_path / "a.jsonl", "jsonl"))
    with pytest.raises(ConfigError, match="csv, jsonl"):
        check_format("xml")


# Cells a spreadsheet would run as a formula (OWASP's list), and a leading quote (so reading back is exact).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "'")


@pytest.mark.parametrize("start", FORMULA_STARTS, ids=["eq", "plus", "minus", "at", "tab", "cr", "quote"])
def test_csv_cells_that_would_start_a_formula_are_neutralised_and_read_back_exact(tmp_path, start):
    value = f'{start}HYPERLINK("http://evil.example","x")'
    row = ("r1", value, -1.5, "plain=text")
    csv_path, jsonl_path = tmp_path / "rows.csv", tmp_path / "rows.jsonl"
    for path, fmt in ((csv_path, "csv"), (jsonl_path, "jsonl")):
        with RowWriter(path, ("id", "cell", "number", "inner"), fmt) as writer:
            writer.write(row)
            writer.close()
    with open(csv_path, newline="", encoding="utf-8") as file:
        cells = list(csv.reader(file))[1]
    assert cells == [
        "r1",
        "'" + value,
        "-1.5",
        "plain=text",
    ]  # numbers stay numbers; only a text's first character counts
    back = next(read_rows(csv_path, "csv"))
    assert back["cell"] == value and back["inner"] == "plain=text"
    assert json.loads(jsonl_path.read_text())["cell"] == value  # JSON lines are not for spreadsheets: exact


def test_csv_cell_and_csv_text_are_inverse():
    for text in ("", "a", "'", "''x", "=1+1", "\r\n", "-", "@x", "x=1"):
        cell = csv_cell(text)
        assert not (cell and cell[0] in "=+-@\t\r") or cell.startswith("'")
        assert csv_text(cell) == text


def test_a_cell_larger_than_the_csv_modules_default_limit_reads_back(tmp_path):
    """A request on record with a long stop list (or prompt) makes a cell over csv's 128 KiB default."""
    path = tmp_path / "requests.csv"
    big = json.dumps({"stop": [f"s{i}" for i in range(40_000)]})
    assert len(big) > csv.field_size_limit()
    with RowWriter(path, ("id", "sampling_params"), "csv") as writer:
        writer.write(("r1", big))
        writer.close()
    [row] = list(read_rows(path, "csv"))
    assert row["sampling_params"] == big
