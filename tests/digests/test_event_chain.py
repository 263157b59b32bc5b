"""event_hash / verify_chain: the hash chain over the events table's rows."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from loraledger.digests import GENESIS_HASH, EventFields, canonical_json, event_hash, first_break, verify_chain

AT = dt.datetime(2026, 11, 22, 12, 0, 0, 123456, tzinfo=dt.timezone.utc)


def chain(n: int) -> list[SimpleNamespace]:
    rows, prev = [], GENESIS_HASH
    for seq in range(1, n + 1):
        fields = EventFields(seq, AT, "request_admitted", f"r{seq}", {"i": seq}, f"k{seq}")
        digest = event_hash(prev, fields)
        rows.append(SimpleNamespace(**fields._asdict(), prev_hash=prev, hash=digest))
        prev = digest
    return rows


def test_event_hash_covers_prev_hash_and_every_field():
    fields = EventFields(1, AT, "engine_started", None, {"a": 1}, None)
    expected = hashlib.sha256(GENESIS_HASH.encode() + canonical_json([1, AT, "engine_started", None, {"a": 1}, None]))
    assert event_hash(GENESIS_HASH, fields) == expected.hexdigest()
    variants = [
        fields._replace(seq=2),
        fields._replace(at=AT + dt.timedelta(microseconds=1)),
        fields._replace(kind="engine_stopped"),
        fields._replace(request_id="r"),
        fields._replace(payload={"a": 1.0}),
        fields._replace(dedup_key="k"),
    ]
    hashes = {event_hash(GENESIS_HASH, v) for v in variants} | {event_hash("1" * 64, fields)}
    assert len(hashes) == len(variants) + 1 and expected.hexdigest() not in hashes


def test_an_intact_chain_verifies():
    assert verify_chain(chain(5)) is None
    assert verify_chain([]) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("payload", {"i": 99}), ("kind", "request_aborted"), ("at", AT + dt.timedelta(seconds=1)), ("dedup_key", None)],
)
def test_an_altered_row_is_named(field, value):
    rows = chain(5)
    setattr(rows[2], field, value)
    assert verify_chain(rows) == 3
    assert "contents" in first_break(rows).reason


def test_a_recomputed_row_breaks_the_next_link():
    rows = chain(5)
    rows[2].payload = {"i": 99}
    rows[2].hash = event_hash(rows[2].prev_hash, EventFields(3, AT, rows[2].kind, "r3", {"i": 99}, "k3"))
    assert verify_chain(rows) == 4


def test_a_missing_row_is_named_by_its_seq():
    rows = chain(5)
    del rows[1]
    assert first_break(rows).seq == 2 and "missing" in first_break(rows).reason
    assert verify_chain(chain(5)[1:]) == 1


def test_verification_can_start_at_a_checkpoint():
    rows = chain(5)
    assert verify_chain(rows[2:], after_seq=2, after_hash=rows[1].hash) is None
    assert verify_chain(rows[2:], after_seq=2, after_hash=GENESIS_HASH) == 3


def test_verification_streams_and_stops_at_the_first_break():
    rows = chain(4)
    rows[1].kind = "tampered"

    def stream() -> Iterator[SimpleNamespace]:
        yield from rows[:2]
        raise AssertionError("read past the first break")

    assert verify_chain(stream()) == 2
