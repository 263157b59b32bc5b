"""The row files of a report: what is selected, how each joined row becomes a line, and the counts kept on the way."""

from __future__ import annotations

import contextlib
import json
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Text, cast, func

from loraledger.audit import queries as q
from loraledger.audit.export import RowWriter
from loraledger.audit.progress import Progress
from loraledger.audit.results import FAILED, ExportedFile, UsageRow

REQUEST_COLUMNS = (
    "request_id", "caller_request_id", "received_at", "tenant", "adapter_fingerprint", "lora_name", "lora_int_id", "lora_path",
    "base_model_fingerprint", "engine_version", "instance_id", "prompt_sha256", "prompt_text", "prompt_token_count",
    "key_id", "chat_template_sha256", "constraint_kind", "constraint_sha256", "constraint_text",
    "adapter_repo_id", "adapter_revision", "adapter_commit_sha", "tools_sha256", "tools_text",
    "sampling_params", "status", "num_completions", "generated_tokens",
)  # fmt: skip
COMPLETION_COLUMNS = (
    "request_id", "completion_index", "tenant", "adapter_fingerprint", "finish_reason", "stop_reason",
    "prompt_token_count", "generated_token_count", "cumulative_logprob", "first_token_at", "finished_at", "text",
    "tool_calls",
)  # fmt: skip

# Selected in file order, so a joined row is a line with few changes. The database formats the
# times (ISO text) and hands over the stored JSON text: no Python object per value on the way.
_REQUEST_SELECT = (
    q.request_column("caller_request_id"),
    q.iso_text(q.R.c.received_at).label("received_iso"),
    func.nullif(q.R.c.tenant, "").label("tenant"),  # an empty tenant exports like no tenant
    *(q.R.c[name] for name in (
        "adapter_fingerprint", "lora_name", "lora_int_id", "lora_path", "base_model_fingerprint", "engine_version",
        "instance_id", "prompt_sha256",
    )),
    q.request_column("prompt_text"),  # salted text from `request_texts`
    *(q.R.c[name] for name in (
        "prompt_token_count", "key_id", "chat_template_sha256", "constraint_kind", "constraint_sha256",
    )),
    q.request_column("constraint_text"),  # salted (revision 0016 on) from `request_texts`
    *(q.R.c[name] for name in ("adapter_repo_id", "adapter_revision", "adapter_commit_sha", "tools_sha256")),
    q.request_column("tools_text"),
    cast(q.R.c.sampling_params, Text).label("sampling_params_json"),
)  # fmt: skip
_COMPLETION_SELECT = (
    *(q.completion_column(name) for name in (
        "adapter_fingerprint", "finish_reason", "stop_reason", "prompt_token_count", "generated_token_count",
        "cumulative_logprob",
    )),
    q.iso_text(q.C.c.first_token_at).label("c_first_token_iso"),
    q.iso_text(q.C.c.finished_at).label("c_finished_iso"),
    q.completion_column("text"),
    q.completion_column("tool_calls"),
)  # fmt: skip
# A request row (see queries.request_groups) is request_id, _REQUEST_SELECT, status_kind; a
# completion row is request_id, c_completion_index, _COMPLETION_SELECT: positions by name, found once.
_REQUEST_LAYOUT = ["request_id", *(c.name for c in _REQUEST_SELECT), "status_kind"]
_RECEIVED, _TENANT = _REQUEST_LAYOUT.index("received_iso"), _REQUEST_LAYOUT.index("tenant")
_ADAPTER, _PROMPT_TOKENS = _REQUEST_LAYOUT.index("adapter_fingerprint"), _REQUEST_LAYOUT.index("prompt_token_count")
_SAMPLING = _REQUEST_LAYOUT.index("sampling_params_json")
_REQUEST_END = _SAMPLING + 1
_COMPLETION_LAYOUT = ["request_id", "c_completion_index", *(c.name for c in _COMPLETION_SELECT)]
_INDEX = _COMPLETION_LAYOUT.index("c_completion_index")
_COMPLETION_START = _INDEX + 1
_FINISH_REASON, _GENERATED = (
    _COMPLETION_LAYOUT.index("c_finish_reason"),
    _COMPLETION_LAYOUT.index("c_generated_token_count"),
)


def group_counts(table: Mapping[str | None, list[int]], key: str) -> list[dict[str, Any]]:
    """[{key: group, requests, completions}] from group -> [requests, completions]; the None group last."""
    ordered = sorted(table.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))
    return [{key: k, "requests": v[0], "completions": v[1]} for k, v in ordered]


def kind_counts(counter: Mapping[str, int], key: str, unit: str) -> list[dict[str, Any]]:
    return [{key: k, unit: v} for k, v in sorted(counter.items())]


class Tally:
    """The counts a manifest carries, accumulated one exported request at a time."""

    def __init__(self) -> None:
        self.requests = self.completions = self.prompt_tokens = self.generated_tokens = self.errors = 0
        self.by_adapter: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])
        self.by_tenant: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])
        self.by_finish_reason: Counter[str] = Counter()
        self.by_status: Counter[str] = Counter()
        self.daily: dict[tuple[str | None, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(self, adapter: str | None, tenant: str | None, day: str, status: str, prompt_tokens: int,
            reasons: Mapping[str, int], generated: int) -> None:  # fmt: skip
        n = sum(reasons.values())
        self.requests += 1
        self.completions += n
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated
        self.errors += status == FAILED
        self.by_status[status] += 1
        self.by_adapter[adapter][0] += 1
        self.by_adapter[adapter][1] += n
        self.by_tenant[tenant][0] += 1
        self.by_tenant[tenant][1] += n
        self.by_finish_reason.update(reasons)
        daily = self.daily[(adapter, day)]
        daily[0] += 1
        daily[1] += generated

    def counts(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completions": self.completions,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "errors": self.errors,
            "by_adapter": group_counts(self.by_adapter, "adapter_fingerprint"),
            "by_tenant": group_counts(self.by_tenant, "tenant"),
            "by_finish_reason": kind_counts(self.by_finish_reason, "finish_reason", "completions"),
            "by_status": kind_counts(self.by_status, "status", "requests"),
        }

    def daily_usage(self) -> list[UsageRow]:
        """Requests and generated tokens per adapter and UTC day (what the report's chart shows)."""
        return [
            UsageRow(
                adapter_fingerprint=fp,
                lora_name=None,
                tenant=None,
                day=day,
                requests=v[0],
                prompt_tokens=0,
                generated_tokens=v[1],
                errors=0,
            )  # fmt: skip
            for (fp, day), v in sorted(self.daily.items(), key=lambda kv: (kv[0][1], kv[0][0] or ""))
        ]


def row_files(fmt: str) -> tuple[str, str]:
    return f"requests.{fmt}", f"completions.{fmt}"


def export_rows(
    conn: Connection, flt: q.RequestFilter, out: Path, fmt: str, tally: Tally, bar: Progress
) -> list[ExportedFile]:
    """Write the requests and completions files for flt, streaming; returns the two files' entries."""
    requests_name, completions_name = row_files(fmt)
    jsonl = fmt == "jsonl"
    groups = q.request_groups(conn, flt, request_columns=_REQUEST_SELECT, completion_columns=_COMPLETION_SELECT)
    # closing: on an error the cursors are closed here, while their connection is still open
    with (
        contextlib.closing(groups),
        RowWriter(out / requests_name, REQUEST_COLUMNS, fmt) as requests,
        RowWriter(out / completions_name, COMPLETION_COLUMNS, fmt) as completions,
    ):
        for request, rows in groups:
            request_id, tenant = request[0], request[_TENANT]
            reasons: Counter[str] = Counter()
            count = generated = 0
            for row in rows:  # written as they stream: a request with a large n holds nothing
                count += 1
                reasons[row[_FINISH_REASON]] += 1
                generated += row[_GENERATED]
                completions.write((request_id, row[_INDEX], tenant, *row[_COMPLETION_START:]))
            status = q.status_of(request.status_kind)
            line = list(request[:_REQUEST_END])
            if jsonl:  # a JSON value in JSON lines; the stored JSON text in a CSV cell
                line[_SAMPLING] = json.loads(line[_SAMPLING])
            requests.write((*line, status, count, generated))
            tally.add(
                request[_ADAPTER], tenant, request[_RECEIVED][:10], status, request[_PROMPT_TOKENS], reasons, generated
            )
            bar.advance()
        return [requests.close(), completions.close()]
