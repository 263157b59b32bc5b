"""One request's lineage as text for `loraledger audit show`: the binding, where its model and adapter came from,
its completions and its events."""

from __future__ import annotations

import json
from typing import Any

from loraledger.audit.listing_output import shown
from loraledger.audit.report_sources import describe
from loraledger.audit.results import RequestLineage
from loraledger.audit.timefmt import iso


def readable_sampling(params: dict[str, Any]) -> dict[str, Any]:
    """The stored sampling parameters with enum values by name ("FINAL_ONLY", not 2)."""
    from loraledger.sampling_params import RequestOutputKind

    out = dict(params)
    kind = out.get("output_kind")
    if isinstance(kind, int) and kind in RequestOutputKind._value2member_map_:
        out["output_kind"] = RequestOutputKind(kind).name
    return out


def _model_lines(source: dict[str, Any] | None) -> list[str]:
    """Where the instance's base model and tokenizer were read from, and how the model's weights are quantized
    (nothing for a log from before it was kept)."""
    if not source or source.get("model") is None:
        return []
    lines = []
    for what in ("model", "tokenizer"):
        name = source.get(what)
        if name is None:
            continue
        origin = describe(source[f"{what}_repo_id"], source[f"{what}_revision"], source[f"{what}_commit_sha"])
        lines.append(f"  {what:<13} {origin or name + ' (local folder)'}")
    if source.get("quantization"):
        lines.append(f"  quantization  {source['quantization']}")
    return lines


def _reading(reading: dict | None) -> str:
    """How the calls are read, as the binding's tool_reading says (revision 0016 on)."""
    if not isinstance(reading, dict):
        return ""
    how = str(reading.get("mode"))
    if reading.get("parser"):
        how += f", parser {reading['parser']}"
    if reading.get("name_index") is not None:
        how += f", function #{reading['name_index']}"
    return f"  ({how}{'' if reading.get('parallel', True) else ', one call'})"


def format_lineage(lineage: RequestLineage) -> str:
    b = lineage.binding
    lines = [
        f"request {b.request_id}  ({lineage.status})",
        f"  caller id     {b.caller_request_id if b.caller_request_id is not None else b.request_id}",
        f"  received      {iso(b.received_at)}",
        f"  tenant        {b.tenant or '-'}" + (f"  (API key {b.key_id})" if b.key_id else ""),
        f"  engine        loraledger {b.engine_version}, base model {b.base_model_fingerprint}",
        f"  instance      {lineage.instance_id or '-'}",
        *_model_lines(lineage.model_source),
        f"  prompt        {b.prompt_token_count} tokens, sha256 {b.prompt_sha256 or '-'}",
    ]
    erased = f"(erased, event {lineage.erased_seq})" if lineage.erased_seq is not None else None
    if b.prompt_text is not None:
        lines.append(f"                {json.dumps(b.prompt_text, ensure_ascii=False)}")
    elif erased is not None and b.prompt_token_ids_commitment is not None:
        lines.append(f"                {erased}")
    lines.append(f"  sampling      {json.dumps(readable_sampling(b.sampling_params), sort_keys=True)}")
    if b.chat_template_sha256 is not None:
        lines.append(f"  chat template sha256 {b.chat_template_sha256}")
    if b.constraint_kind is not None:
        lines.append(f"  constraint    {b.constraint_kind}, sha256 {b.constraint_sha256 or '-'}")
        if b.constraint_text is not None:
            lines.append(f"                {b.constraint_text}")
        elif erased is not None and b.constraint_commitment is not None:
            lines.append(f"                {erased}")
    if b.tools_sha256 is not None:
        lines.append(f"  tools         sha256 {b.tools_sha256}" + _reading(b.tool_reading))
        if b.tools_text is not None:
            lines.append(f"                {b.tools_text}")
        elif erased is not None and b.tools_commitment is not None:
            lines.append(f"                {erased}")
    if b.adapter_fingerprint is None:
        lines.append("  adapter       none (base model)")
    else:
        lines.append(f"  lora_request  name={b.lora_name} int_id={b.lora_int_id} path={b.lora_path}")
        lines.append(f"  adapter       {b.adapter_fingerprint}")
        source = describe(b.adapter_repo_id, b.adapter_revision, b.adapter_commit_sha)
        if source is not None:
            lines.append(f"  adapter from  {source}")
        a = lineage.adapter
        if a is not None:
            lines.append(
                f"                {a.name}, rank {a.rank}, alpha {a.alpha:g}, targets {', '.join(a.target_modules)}"
            )
    lines.append(f"completions ({len(lineage.completions)})")
    for c in lineage.completions:
        adapter = "base" if c.adapter_fingerprint is None else c.adapter_fingerprint[:12]
        lines.append(
            f"  [{c.index}] {c.finish_reason:<6} {c.generated_token_count} tokens  adapter {adapter}  finished {iso(c.finished_at)}"
        )
        gone = erased is not None and c.text_commitment is not None
        lines.append(f"      {erased if gone else json.dumps(c.text, ensure_ascii=False)}")
        if c.tool_calls is not None:
            lines.append(f"      tool calls {c.tool_calls}")
        elif erased is not None and c.tool_calls_commitment is not None:
            lines.append(f"      tool calls {erased}")
    lines.append(f"events ({len(lineage.events)})")
    for e in lineage.events:
        lines.append(f"  #{e.sequence:<8} {iso(e.at)}  {e.kind:<20} {e.hash[:16]}")
    return "\n".join(shown(line) for line in lines) + "\n"
