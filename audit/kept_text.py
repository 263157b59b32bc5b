"""Salted text as readers show it: a binding's prompt (and, revision 0016 on, its tools and constraint text) and its
completions' text, token ids and tool calls, read back from `request_texts` (revision 0013 on), or the `erased` event
that removed them."""

from __future__ import annotations

import msgspec
from sqlalchemy import Connection, select

from loraledger.store import texts
from loraledger.store.models import Erasure
from loraledger.store.records import CompletionRecord, RequestRecord

X = Erasure.__table__


def with_kept_text(
    conn: Connection, binding: RequestRecord, completions: list[CompletionRecord]
) -> tuple[RequestRecord, list[CompletionRecord], int | None]:
    """binding and completions with their kept text filled in (the prompt, tools and constraint text; each
    completion's text, ids and tool calls), and the seq of the erasure that removed it (or None)."""
    salted = binding.prompt_token_ids_commitment is not None or any(c.text_commitment is not None for c in completions)
    salted = salted or binding.tools_commitment is not None or binding.constraint_commitment is not None
    if not salted:
        return binding, completions, None
    rid = binding.request_id
    kept = texts.stored(conn, [rid])
    erased = conn.execute(select(X.c.seq).where(X.c.request_id == rid)).scalar()
    fill = {}
    for part, name, commitment in ((texts.PROMPT, "prompt_text", binding.prompt_token_ids_commitment),
                                   (texts.TOOLS, "tools_text", binding.tools_commitment),
                                   (texts.CONSTRAINT, "constraint_text", binding.constraint_commitment)):  # fmt: skip
        row = kept.get((rid, part, 0)) if commitment is not None else None
        if row is not None:
            fill[name] = row.text
    binding = msgspec.structs.replace(binding, **fill) if fill else binding
    filled = []
    for c in completions:
        row = kept.get((rid, texts.COMPLETION, c.index)) if c.text_commitment is not None else None
        if row is not None:
            c = msgspec.structs.replace(c, text=row.text, token_ids=list(row.token_ids))
        calls = kept.get((rid, texts.TOOL_CALLS, c.index)) if c.tool_calls_commitment is not None else None
        filled.append(c if calls is None else msgspec.structs.replace(c, tool_calls=calls.text))
    return binding, filled, erased
