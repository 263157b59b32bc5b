"""The report's report.html: one self-contained page (inline CSS and SVG, no scripts, no external assets)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from loraledger.audit.report_sources import describe
from loraledger.audit.results import AdapterInfo, UsageRow
from loraledger.audit.timefmt import iso
from loraledger.store.records import AdapterRecord

# Tableau 10: distinct for most color-vision deficiencies.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
BASE_LABEL = "base model"

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:#1f2328;margin:0;background:#f6f8fa}
main{max-width:1120px;margin:0 auto;padding:24px 32px 48px;background:#fff}
h1{font-size:26px;margin:0 0 4px}h2{font-size:19px;margin:32px 0 10px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.sub{color:#57606a;margin:0 0 16px}
.banner{padding:12px 16px;border-radius:6px;font-weight:600;margin:16px 0}
.ok{background:#dafbe1;border:1px solid #4ac26b;color:#116329}.bad{background:#ffebe9;border:1px solid #ff8182;color:#a40e26}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(140px,1fr));gap:12px}
.card{border:1px solid #d0d7de;border-radius:6px;padding:10px 14px;background:#f6f8fa}
.card .v{font-size:24px;font-weight:700}.card .k{color:#57606a;font-size:13px}
table{border-collapse:collapse;width:100%;font-size:14px;margin:6px 0}
th,td{border-bottom:1px solid #d8dee4;padding:6px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}th.n,td.n{text-align:right}td.n{font-variant-numeric:tabular-nums}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;word-break:break-all}
.swatch{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:6px;vertical-align:-1px}
.legend span.item{margin-right:16px;white-space:nowrap;font-size:13px}
.hbar{height:14px;background:#4e79a7;border-radius:2px;min-width:1px}
.muted{color:#57606a}
"""


def when(text_or_unix: str | float | None) -> str:
    """An instant for people: 2026-11-22 13:45:07Z (the exports keep the microseconds)."""
    if text_or_unix is None:
        return ""
    text = iso(text_or_unix) if isinstance(text_or_unix, (int, float)) else text_or_unix
    return text[:10] + " " + text[11:19] + "Z"


def adapter_label(name: str | None, fingerprint: str | None) -> str:
    if fingerprint is None:
        return BASE_LABEL
    return f"{name or 'adapter'} ({fingerprint[:12]})"


def render_report_html(
    manifest: Mapping[str, Any],
    adapters: Sequence[AdapterInfo],
    daily: Sequence[UsageRow],
    signing: Mapping[str, Any] | None = None,
) -> str:
    """The page for one report: manifest (without its signature), the adapters used, usage per adapter and day.

    signing: the signature the bundle gets (its algorithm and key_id / public_key, no value: the
    value covers this page, so it is made after it); None when not known.
    """
    counts = manifest["counts"]
    window = manifest["window"]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>loraledger audit report {escape(when(window['since']))} to {escape(when(window['until']))}</title>",
        f"<style>{_CSS}</style></head><body><main>",
        "<h1>loraledger audit report</h1>",
        f'<p class="sub">Window {escape(when(window["since"]))} to {escape(when(window["until"]))} (UTC, end exclusive) · '
        f"generated {escape(when(manifest['generated_at']))} · loraledger {escape(str(manifest['engine_version']))}"
        f"{_filters_text(manifest['filters'])}</p>",
        _verification_banner(manifest["verification"]),
        _summary_cards(counts),
        _usage_section(adapters, daily, window),
        _inventory_section(adapters, counts["by_adapter"]),
        _tenant_section(counts["by_tenant"]),
        _breakdown_section("Finish reasons", "finish_reason", "completions", counts["by_finish_reason"]),
        _breakdown_section("Request outcomes", "status", "requests", counts["by_status"]),
        _integrity_section(manifest, signing),
        "</main></body></html>",
    ]
    return "\n".join(parts) + "\n"


def _filters_text(filters: Mapping[str, Any]) -> str:
    active = [f"{k} = {v}" for k, v in filters.items() if v is not None]
    return f" · filters: {escape(', '.join(active))}" if active else ""


def _verification_banner(verification: Mapping[str, Any]) -> str:
    if verification["ok"]:
        head = verification.get("head") or {}
        where = (
            f" Head: sequence {head.get('sequence')}, hash <code>{escape(str(head.get('hash')))}</code>."
            if head
            else ""
        )
        return f'<div class="banner ok">Audit log verified: hash chain intact, no gaps, every binding and completion matches.{where}</div>'
    seq = verification.get("first_bad_sequence")
    at = f" at sequence {seq}" if seq is not None else ""
    more = verification.get("problem_count", 1) - 1
    extra = f" ({more} more problem{'s' if more != 1 else ''})" if more > 0 else ""
    return f'<div class="banner bad">Audit log verification FAILED{at}: {escape(str(verification.get("problem")))}{extra}</div>'


def _summary_cards(counts: Mapping[str, Any]) -> str:
    items = [
        ("requests", counts["requests"]),
        ("completions", counts["completions"]),
        ("prompt tokens", counts["prompt_tokens"]),
        ("generated tokens", counts["generated_tokens"]),
        ("failed requests", counts["errors"]),
        ("adapters (incl. base)", len(counts["by_adapter"])),
        ("tenants", len(counts["by_tenant"])),
    ]
    cards = "".join(
        f'<div class="card"><div class="v">{v:,}</div><div class="k">{escape(k)}</div></div>' for k, v in items
    )
    return f'<h2>Summary</h2><div class="cards">{cards}</div>'


def _colors(adapters: Sequence[AdapterInfo], daily: Sequence[UsageRow]) -> dict[str | None, tuple[str, str]]:
    """fingerprint -> (label, color); the base model is always grey so adapters keep the bright colors."""
    names = {a.record.fingerprint: a.record.name for a in adapters}
    keys = sorted(
        {row.adapter_fingerprint for row in daily} | set(names), key=lambda k: (k is None, names.get(k) or "", k or "")
    )
    out: dict[str | None, tuple[str, str]] = {}
    i = 0
    for key in keys:
        if key is None:
            out[None] = (BASE_LABEL, "#8c959f")
        else:
            out[key] = (adapter_label(names.get(key), key), _color(i))
            i += 1
    return out


def _color(i: int) -> str:
    if i < len(PALETTE):
        return PALETTE[i]
    hue = (i * 137.508) % 360  # golden angle: successive hues stay far apart
    return f"hsl({hue:.0f},55%,50%)"


def _usage_section(adapters: Sequence[AdapterInfo], daily: Sequence[UsageRow], window: Mapping[str, str]) -> str:
    if not daily:
        return "<h2>Usage per adapter over time</h2><p class='muted'>No requests in this window.</p>"
    colors = _colors(adapters, daily)
    # every day of the window gets a slot, so quiet days show as gaps rather than vanish
    first = min([window["since"][:10], *(r.day for r in daily if r.day)])
    last_instant = dt.datetime.fromisoformat(window["until"].replace("Z", "+00:00")) - dt.timedelta(microseconds=1)
    last = max([last_instant.date().isoformat(), *(r.day for r in daily if r.day)])
    days = _day_range(first, last)
    index = {d: i for i, d in enumerate(days)}
    requests: dict[str | None, list[float]] = {k: [0.0] * len(days) for k in colors}
    tokens: dict[str | None, list[float]] = {k: [0.0] * len(days) for k in colors}
    for row in daily:
        if row.day is None:
            continue
        requests[row.adapter_fingerprint][index[row.day]] += row.requests
        tokens[row.adapter_fingerprint][index[row.day]] += row.generated_tokens
    used = [k for k in colors if any(requests[k])]
    series_r = [(colors[k][0], colors[k][1], requests[k]) for k in used]
    series_t = [(colors[k][0], colors[k][1], tokens[k]) for k in used]
    legend = "".join(
        f'<span class="item"><span class="swatch" style="background:{colors[k][1]}"></span>{escape(colors[k][0])}</span>'
        for k in used
    )
    return (
        "<h2>Usage per adapter over time</h2>"
        f'<div class="legend">{legend}</div>'
        + stacked_bar_svg(days, series_r, title="Requests per day (UTC)")
        + stacked_bar_svg(days, series_t, title="Generated tokens per day (UTC)")
    )


def _day_range(first: str, last: str) -> list[str]:
    start, end = dt.date.fromisoformat(first), dt.date.fromisoformat(last)
    return [(start + dt.timedelta(days=i)).isoformat() for i in range((end - start).days + 1)]


def _nice_step(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is at least value (and at least 1)."""
    if value <= 1:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if value <= step * exp:
            return float(step * exp)
    return float(10 * exp)


def stacked_bar_svg(days: Sequence[str], series: Sequence[tuple[str, str, Sequence[float]]], *, title: str) -> str:
    """Bars per day, one stacked segment per series (label, color, values per day), with axes and tooltips."""
    width, height = 1056, 300
    left, right, top, bottom = 64, 16, 30, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    totals = [sum(s[2][i] for s in series) for i in range(len(days))]
    y_max = 4 * _nice_step(max(totals, default=0) / 4)
    slot = plot_w / max(1, len(days))
    bar_w = max(1.0, slot * 0.8)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="100%" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" style="max-width:{width}px;display:block;margin:8px 0 20px">',
        f'<text x="{left}" y="18" font-size="14" font-weight="600" fill="#1f2328">{escape(title)}</text>',
    ]
    for k in range(5):
        value = y_max * k / 4
        y = top + plot_h - plot_h * k / 4
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#d8dee4" stroke-width="1"/>'
        )
        out.append(
            f'<text x="{left - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end" fill="#57606a">{_short_number(value)}</text>'
        )
    for i, day in enumerate(days):
        x = left + i * slot + (slot - bar_w) / 2
        y = top + plot_h
        for label, color, values in series:
            v = values[i]
            if v <= 0:
                continue
            h = plot_h * v / y_max
            y -= h
            out.append(
                f'<rect x="{x:.2f}" y="{y:.2f}" width="{bar_w:.2f}" height="{h:.2f}" fill="{color}">'
                f"<title>{escape(day)} · {escape(label)}: {int(v):,}</title></rect>"
            )
    step = max(1, math.ceil(len(days) / 12))
    for i in range(0, len(days), step):
        x = left + i * slot + slot / 2
        out.append(
            f'<text x="{x:.1f}" y="{top + plot_h + 16}" font-size="11" text-anchor="middle" fill="#57606a">{escape(days[i][5:])}</text>'
        )
    out.append(
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" stroke="#57606a" stroke-width="1"/>'
    )
    out.append(
        f'<text x="{left + plot_w / 2:.0f}" y="{height - 6}" font-size="11" text-anchor="middle" fill="#57606a">{escape(days[0][:4])} (month-day)</text>'
    )
    out.append("</svg>")
    return "".join(out)


def _short_number(value: float) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:g}{suffix}"
    return f"{value:g}"


def _source_note(rec: AdapterRecord) -> str:
    """Where the adapter's content came from (a Hub repo and commit), under its name; nothing for a folder."""
    origin = describe(rec.repo_id, rec.revision, rec.commit_sha)
    return "" if origin is None else f"<br><span class='muted'>{escape(origin)}</span>"


def _inventory_section(adapters: Sequence[AdapterInfo], by_adapter: Sequence[Mapping[str, Any]]) -> str:
    in_window = {row["adapter_fingerprint"]: row for row in by_adapter}
    rows = []
    for info in sorted(adapters, key=lambda a: (a.record.name, a.record.fingerprint)):
        rec = info.record
        counts = in_window.get(rec.fingerprint, {"requests": 0, "completions": 0})
        rows.append(
            f"<tr><td>{escape(rec.name)}{_source_note(rec)}</td><td><code>{escape(rec.fingerprint)}</code></td>"
            f'<td class="n">{rec.rank}</td><td class="n">{rec.alpha:g}</td><td>{escape(", ".join(rec.target_modules))}</td>'
            f"<td><code>{escape(rec.base_model_fingerprint[:16])}</code></td>"
            f"<td>{escape(when(info.first_used))}</td><td>{escape(when(info.last_used))}</td>"
            f'<td class="n">{counts["requests"]:,}</td><td class="n">{counts["completions"]:,}</td></tr>'
        )
    base = in_window.get(None)
    if base is not None:
        rows.append(
            f"<tr><td>{BASE_LABEL}</td><td class='muted'>(no adapter)</td><td></td><td></td><td></td><td></td><td></td><td></td>"
            f'<td class="n">{base["requests"]:,}</td><td class="n">{base["completions"]:,}</td></tr>'
        )
    if not rows:
        return "<h2>Adapter inventory</h2><p class='muted'>No adapter was used in this window.</p>"
    return (
        "<h2>Adapter inventory</h2><table><thead><tr><th>Name</th><th>Fingerprint (sha256)</th><th class='n'>Rank</th>"
        "<th class='n'>Alpha</th><th>Target modules</th><th>Base model</th><th>First used</th><th>Last used</th>"
        "<th class='n'>Requests</th><th class='n'>Completions</th>"
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        "<p class='muted'>Requests and completions count this window; first and last use span the whole log.</p>"
    )


def _tenant_section(by_tenant: Sequence[Mapping[str, Any]]) -> str:
    rows = "".join(
        f"<tr><td>{escape(row['tenant']) if row['tenant'] is not None else '<span class=muted>(none)</span>'}</td>"
        f'<td class="n">{row["requests"]:,}</td><td class="n">{row["completions"]:,}</td></tr>'
        for row in by_tenant
    )
    return (
        "<h2>Tenants</h2><table><thead><tr><th>Tenant</th><th class='n'>Requests</th><th class='n'>Completions</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def _breakdown_section(title: str, key: str, unit: str, rows: Sequence[Mapping[str, Any]]) -> str:
    total = sum(row[unit] for row in rows) or 1
    body = "".join(
        f"<tr><td>{escape(str(row[key]))}</td><td class='n'>{row[unit]:,}</td><td class='n'>{row[unit] / total:.1%}</td>"
        f'<td style="width:50%"><div class="hbar" style="width:{100 * row[unit] / total:.1f}%"></div></td></tr>'
        for row in rows
    )
    return (
        f"<h2>{escape(title)}</h2><table><thead><tr><th>{escape(key.replace('_', ' '))}</th><th class='n'>{escape(unit)}</th>"
        f"<th class='n'>share</th><th></th></tr></thead><tbody>{body}</tbody></table>"
    )


def _signature_row(signing: Mapping[str, Any] | None) -> str:
    """Whether and how the bundle is signed: the scheme, and the key that signed it."""
    if signing is None:
        return ""
    algorithm = str(signing.get("algorithm"))
    if algorithm == "none":
        text = ("<span class='muted'>unsigned</span> (written with <code>--unsigned</code>: nothing proves "
                "who wrote this bundle)")  # fmt: skip
    elif algorithm == "ed25519":
        text = (f"Ed25519, public key <code>{escape(str(signing.get('public_key')))}</code> "
                "(check it with the signer's public key: <code>verify-report DIR --key-file pub.pem</code>)")  # fmt: skip
    elif algorithm == "hmac-sha256":
        text = (f"HMAC-SHA256 with a shared key, key id <code>{escape(str(signing.get('key_id')))}</code> "
                "(check it with the same key in <code>$LORALEDGER_REPORT_KEY</code>)")  # fmt: skip
    else:
        text = escape(algorithm)
    return f"<tr><th>Signature</th><td>{text}; it covers manifest.json, which lists every file's sha256, this page's included</td></tr>"


def _integrity_section(manifest: Mapping[str, Any], signing: Mapping[str, Any] | None = None) -> str:
    files = "".join(
        f"<tr><td>{escape(f['name'])}</td><td class='n'>{f['rows']:,}</td><td class='n'>{f['bytes']:,}</td><td><code>{escape(f['sha256'])}</code></td></tr>"
        for f in manifest["files"]
    )
    head = manifest.get("chain_head")
    seq = manifest["sequence"]
    previous = manifest.get("previous")
    lines = [
        _signature_row(signing),
        f"<tr><th>Events in window</th><td>sequence {seq['first']} to {seq['last']}</td></tr>"
        if seq["first"] is not None
        else "<tr><th>Events in window</th><td class='muted'>none</td></tr>",
        f"<tr><th>Chain head at export</th><td>sequence {head['sequence']}, <code>{escape(head['hash'])}</code></td></tr>"
        if head
        else "<tr><th>Chain head at export</th><td class='muted'>empty log</td></tr>",
        f"<tr><th>Previous report</th><td>manifest sha256 <code>{escape(previous['manifest_sha256'])}</code></td></tr>"
        if previous
        else "<tr><th>Previous report</th><td class='muted'>none given</td></tr>",
    ]
    return (
        "<h2>Integrity</h2><table><tbody>" + "".join(lines) + "</tbody></table>"
        "<table><thead><tr><th>File</th><th class='n'>Rows</th><th class='n'>Bytes</th><th>sha256</th></tr></thead>"
        f"<tbody>{files}</tbody></table>"
        "<p class='muted'>manifest.json lists these digests and the signature over the manifest; "
        "check the bundle with <code>loraledger audit verify-report DIR</code>.</p>"
    )
