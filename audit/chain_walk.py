"""The chain as verify walks it: each event's seq, prev_hash and hash, one event at a time, in seq order.

The hash is the one loraledger.digests defines (DIGESTS.md); a malformed row is a problem reported at its
place, never an exception.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Row

from loraledger.audit.event_rows import EventRows, Tables
from loraledger.audit.problems import Problems
from loraledger.audit.raw_rows import describe
from loraledger.digests import GENESIS_HASH, EventFields, event_hash
from loraledger.store.records import Checkpoint


class ChainWalk:
    """The ordered pass over the events: chain, gaps, checkpoint, and each event's rows (EventRows)."""

    def __init__(self, tables: Tables, found: Problems, checkpoint: Checkpoint | None, rows: EventRows):
        self.t, self.found, self.checkpoint, self.rows = tables, found, checkpoint, rows
        self.expected, self.prev = 1, GENESIS_HASH
        self.head: Checkpoint | None = None
        self.events = 0

    def event(self, row: Row[Any]) -> None:
        self.events += 1
        m = row._mapping
        ev, bad = self.t.events.decode(m)
        seq = ev.get("seq")
        if seq is None:  # not an integer: the row has no place in the chain
            raw = m["seq"]
            self.found.add(None, f"`events` row with seq {raw!r} cannot be placed in the chain: {describe(bad)}",
                           table="events", key={"seq": raw if isinstance(raw, (str, int, float)) else repr(raw)})  # fmt: skip
            return
        found, key = self.found, {"seq": seq}
        if seq != self.expected:
            missing = f"{self.expected}" if seq == self.expected + 1 else f"{self.expected} to {seq - 1}"
            found.add(self.expected, f"event seq {missing} is missing (the next event on record is seq {seq}): rows were deleted",
                      table="events", key={"seq": self.expected})  # fmt: skip
        elif "prev_hash" in ev and ev["prev_hash"] != self.prev:
            found.add(seq, f"prev_hash does not match the hash of event {seq - 1}: event {seq - 1} or {seq} was rewritten",
                      table="events", key=key)  # fmt: skip
        if bad:
            found.add(
                seq,
                f"`events` row seq={seq} cannot be verified: {describe(bad)}",
                ev.get("request_id"),
                table="events",
                key=key,
            )
        else:
            self._check_hash(seq, ev)
        if self.checkpoint is not None and seq == self.checkpoint.sequence and ev.get("hash") != self.checkpoint.hash:
            found.add(seq, f"event {seq}'s hash differs from the checkpoint's: the log up to the checkpoint was rewritten",
                      table="events", key=key)  # fmt: skip
        if not bad:
            self.rows.check(seq, ev, m)
        self.expected, self.prev = seq + 1, ev.get("hash")
        if isinstance(ev.get("hash"), str) and "at" in ev:
            self.head = Checkpoint(sequence=seq, hash=ev["hash"], at=ev["at"].timestamp())

    def _check_hash(self, seq: int, ev: dict[str, Any]) -> None:
        fields = EventFields(
            seq, ev["at"], ev["kind"], ev["request_id"], ev["payload"], ev["dedup_key"], ev.get("instance_id")
        )
        try:
            intact = event_hash(ev["prev_hash"], fields) == ev["hash"]
        except (
            TypeError,
            ValueError,
            UnicodeEncodeError,
        ):  # a payload with no canonical form cannot be what was hashed
            intact = False
        if not intact:
            self.found.add(seq, f"the hash of event {seq} ({ev['kind']}) does not match its contents: the row was altered",
                           ev["request_id"], table="events", key={"seq": seq})  # fmt: skip
