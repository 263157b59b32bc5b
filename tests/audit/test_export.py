"""Row files: CSV and JSONL written with a running digest, read back row by row."""

from __future__ import annotations

import pytest

from loraledger.audit.export import RowWriter, check_format, read_rows, sha256_file
from loraledger.errors import ConfigError

ROWS = [
    ("r1", 3, "line one\nline two, with \"quotes\"", None, 1.5),
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
    assert entry.sha256 == sha256_file(path)
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
