"""The audit log's own request keys: UUIDv7 text ids (RFC 9562), made by the engine for every request.

Why UUIDv7 and not a ULID or a counter: the key must be unique across engines, restarts and machines
writing one database (74 random bits per id), ordered by time (its first 48 bits are the Unix time in
milliseconds, so keys sort, and index, in the order requests arrived), and readable by any tool that
knows UUIDs (PostgreSQL's uuid type parses it; its version nibble says 7). The text form is the
canonical lowercase 36-character one, whose string order is its time order. Within one process ids made
in the same millisecond stay ordered: the 12-bit `rand_a` field counts up (RFC 9562 section 6.2,
method 1) and a counter overflow borrows the next millisecond.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_counter = 0
_COUNTER_MAX = 0xFFF


def new_audit_id() -> str:
    """A new UUIDv7 in its canonical text form (`0193a1f2-...-7...`), later than every id this process made before."""
    global _last_ms, _counter
    rand = int.from_bytes(os.urandom(8), "big")
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms > _last_ms:
            _last_ms, _counter = ms, rand >> 53  # a random start (11 bits) leaves room to count up within the ms
        elif _counter < _COUNTER_MAX:
            _counter += 1
        else:
            _last_ms, _counter = _last_ms + 1, 0
        ms, counter = _last_ms, _counter
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | (rand & ((1 << 62) - 1))
    return str(uuid.UUID(int=value))
