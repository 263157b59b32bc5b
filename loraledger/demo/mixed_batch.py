"""The demo's one mixed batch: the same questions to the base model and to each adapter in one `LLM.chat` call,
printed as a table of who wrote what, then the proof from the audit log (`audit show`, the SQL that names the
adapter content behind an answer, `audit verify`)."""

from __future__ import annotations

import re
import sqlite3
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loraledger.demo.data import SCHEMA

QUESTIONS = ("What is the capital of Japan?", "Which continent is Brazil in?", "How many people live in Canada?")
PIRATE_WORDS = ("arr", "matey", "ahoy", "savvy", "hearty", "yo ho")  # words no plain answer uses
MAX_TOKENS = 48
ANSWER_WIDTH = 56  # the table's answer column wraps there

# which adapter content wrote this answer: the completion, the binding it was made under, the adapter's record
PROOF_SQL = """\
SELECT c.text, r.lora_name, a.fingerprint, a.path, a.rank, a.target_modules
FROM completions c
JOIN requests r ON r.request_id = c.request_id
LEFT JOIN adapters a ON a.fingerprint = c.adapter_fingerprint
WHERE c.request_id = :request_id"""


@dataclass(frozen=True)
class Row:
    question: str
    adapter: str  # "(base)" or the adapter's name
    answer: str
    fingerprint: str  # the adapter's content fingerprint, "" for the base model
    audit_id: str


def run_batch(
    model_dir: Path, adapters: Mapping[str, Path], audit_url: str, *, device: str = "auto", max_tokens: int = MAX_TOKENS
) -> list[Row]:
    """Every question to the base model and to each adapter, all in one batch; one Row per answer, in order."""
    from loraledger import LLM, LoRARequest, SamplingParams

    loras = [None] + [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    conversations, per_request = [], []
    for question in QUESTIONS:
        for lora in loras:
            conversations.append([{"role": "user", "content": question}])
            per_request.append(lora)
    rank = max(_rank(path) for path in adapters.values()) if adapters else 8
    with LLM(
        model=str(model_dir),
        enable_lora=True,
        max_loras=max(1, len(adapters)),
        max_lora_rank=rank,
        audit_url=audit_url,
        device=device,
    ) as llm:
        outputs = llm.chat(
            conversations,
            SamplingParams(temperature=0, max_tokens=max_tokens),
            lora_request=per_request,
            use_tqdm=False,
        )
    rows = []
    for conv, out in zip(conversations, outputs):
        fingerprint = (out.metrics.adapter_fingerprint or "") if out.metrics else ""
        rows.append(
            Row(
                question=conv[0]["content"],
                adapter=out.lora_request.lora_name if out.lora_request else "(base)",
                answer=out.outputs[0].text.strip(),
                fingerprint=fingerprint,
                audit_id=out.audit_id or out.request_id,
            )
        )
    return rows


def print_rows(rows: Sequence[Row], out=sys.stdout, answer_width: int = ANSWER_WIDTH) -> None:
    """question / adapter / answer / fingerprint / audit id; answers whole, wrapped at answer_width."""
    table = [("question", "adapter", "answer", "fingerprint", "audit id")]
    for r in rows:
        lines = textwrap.wrap(" ".join(r.answer.split()), answer_width) or [""]
        table.append((r.question, r.adapter, lines[0], r.fingerprint[:12] or "-", r.audit_id))
        table += [("", "", line, "", "") for line in lines[1:]]
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    for n, cells in enumerate(table):
        out.write("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(cells)).rstrip() + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def proof_rows(audit_url: str, request_id: str) -> list[tuple]:
    """PROOF_SQL run against the audit log for one request."""
    from sqlalchemy import text

    from loraledger.audit import AuditLog

    with AuditLog(audit_url) as log, log.snapshot() as conn:
        return [tuple(row) for row in conn.execute(text(PROOF_SQL), {"request_id": request_id})]


def pirate_like(answer: str) -> bool:
    """Whether the answer speaks as the pirate adapter was taught to (one of PIRATE_WORDS at least)."""
    return any(re.search(rf"\b{word}\b", answer, re.IGNORECASE) for word in PIRATE_WORDS)


def sql_select(answer: str) -> bool:
    """Whether the answer is one SQLite SELECT statement over the demo's schema (SQLite compiles it)."""
    statement = answer.strip()
    if not statement.upper().startswith("SELECT"):
        return False
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute(SCHEMA)
        conn.execute(f"EXPLAIN {statement}")
    except sqlite3.Error:
        return False
    finally:
        conn.close()
    return True


def _rank(adapter_dir: Path) -> int:
    import json

    return int(json.loads((adapter_dir / "adapter_config.json").read_text())["r"])
