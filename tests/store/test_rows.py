"""Record <-> row conversions: unix floats to UTC datetimes and back, JSON values in stored form."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import msgspec

from loraledger.store.rows import completion_row, request_record, request_row
from tests.db_fixtures import T0, make_completion, make_request


def test_a_request_survives_row_and_back():
    record = make_request("r1")
    row = request_row(record)
    assert row["received_at"] == dt.datetime.fromtimestamp(T0, dt.timezone.utc)
    assert request_record(SimpleNamespace(**row)) == record


def test_json_values_are_stored_as_json_reads_them_back():
    odd = msgspec.structs.replace(make_request("r1"), sampling_params={"logit_bias": {7: 1.5}, "stop": ("a",)})
    assert request_row(odd)["sampling_params"] == {"logit_bias": {"7": 1.5}, "stop": ["a"]}


def test_a_completion_row_names_its_index_completion_index():
    row = completion_row(make_completion("r1", index=2))
    assert row["completion_index"] == 2 and "index" not in row
    assert row["first_token_at"] < row["finished_at"] and row["finished_at"].tzinfo is dt.timezone.utc
