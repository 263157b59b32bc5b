"""The decision verify makes for each salted commitment and its `request_texts` row (the prompt and completion text
of audit/text_checks.py, the tools, constraint and tool calls of audit/content_checks.py): the row matches, or it is
gone and an erasure is on record; a row still there after its erasure, or one that does not match, is a problem."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from loraledger.audit.problems import Problems

Finding = Literal["missing", "erased", "mismatch"]


def check_text_row(
    found: Problems, row: Any, matches: Callable[[Any], bool], key: dict[str, Any], say: Callable[[Finding], str]
) -> bool:
    """row: the commitment joined to its text row (`salt` None where there is none) and its erasure (`erased_at`,
    the erased event's seq or None); key: the text row's key. `say` words each finding for this part. Returns whether
    the text is erased as the log says."""
    rid, seq = key["request_id"], row.erased_at
    if row.salt is None:
        if seq is None:
            found.add(None, say("missing"), rid, table="request_texts", key=key)
        return seq is not None
    if seq is not None:
        found.add(seq, say("erased"), rid, table="request_texts", key=key)
    if not matches(row):
        found.add(None, say("mismatch"), rid, table="request_texts", key=key)
    return False
