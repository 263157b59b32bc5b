"""Salted text as readers show it: a binding's prompt and its completions' text and token ids, read back from
`request_texts` (revision 0013 on), or the `erased` event that removed them."""

from __future__ import annotations

import msgspec
from sqlalchemy import Connection, select

from loraledger.store import texts
from loraledger.store.models import Erasure
from loraledger.store.records import COMPLETION, PROMPT, CompletionRecord, RequestRecord

X = Erasure.__table__


def with_kept_text(
    conn: Connection, binding: RequestRecord, completions: list[CompletionRecord]
) -> tuple[RequestRecord, list[CompletionRecord], int | None]:
    """binding and completions with their kept text filled in, and the seq of the erasure that removed it (or None)."""
    salted = binding.prompt_token_ids_commitment is not None or any(c.text_commitment is not None for c in completions)
    if not salted:
        return binding, completions, None
    rid = binding.request_id
    kept = texts.stored(conn, [rid])
    erased = conn.execute(select(X.c.seq).where(X.c.request_id == rid)).scalar()
    prompt = kept.get((rid, PROMPT, 0))
    if prompt is not None:
        binding = msgspec.structs.replace(binding, prompt_text=prompt.text)
    filled = []
    for c in completions:
        row = kept.get((rid, COMPLETION, c.index)) if c.text_commitment is not None else None
        filled.append(c if row is None else msgspec.structs.replace(c, text=row.text, token_ids=list(row.token_ids)))
    return binding, filled, erased
