"""report.html: self-contained, escaped, and rendered by headless Chromium into a non-blank page."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from loraledger.audit import AuditLog
from loraledger.audit.html import PALETTE, _color, render_report_html, stacked_bar_svg
from loraledger.audit.report import HTML, write_report
from loraledger.audit.results import AdapterInfo, UsageRow
from loraledger.audit.signing import hmac_key_id
from loraledger.store.audit_store import AuditStore
from loraledger.store.migrate import upgrade
from loraledger.store.records import AdapterRecord
from tests.audit.png import read_png
from tests.audit.synth import DAY, START, build_log

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _manifest(**overrides) -> dict:
    manifest = {
        "generated_at": "2026-11-30T08:00:00.000000Z",
        "engine_version": "0.1.0",
        "window": {"since": "2026-11-22T00:00:00.000000Z", "until": "2026-11-25T00:00:00.000000Z"},
        "filters": {"adapter": None, "tenant": None},
        "counts": {
            "requests": 3,
            "completions": 4,
            "prompt_tokens": 30,
            "generated_tokens": 40,
            "errors": 1,
            "by_adapter": [
                {"adapter_fingerprint": "ab" * 32, "requests": 2, "completions": 3},
                {"adapter_fingerprint": None, "requests": 1, "completions": 1},
            ],
            "by_tenant": [{"tenant": "<script>alert(1)</script>", "requests": 3, "completions": 4}],
            "by_finish_reason": [{"finish_reason": "stop", "completions": 4}],
            "by_status": [{"status": "finished", "requests": 2}, {"status": "failed", "requests": 1}],
        },  # fmt: skip
        "sequence": {"first": 1, "last": 9},
        "chain_head": {"sequence": 9, "hash": "cd" * 32, "at": 0.0},
        "verification": {"ok": True, "head": {"sequence": 9, "hash": "cd" * 32, "at": 0.0}, "problem_count": 0},
        "previous": None,
        "files": [{"name": "requests.csv", "rows": 3, "bytes": 100, "sha256": "ef" * 32}],
    }
    manifest.update(overrides)
    return manifest


ADAPTER = AdapterInfo(
    record=AdapterRecord(
        fingerprint="ab" * 32,
        name="legal<qa>",
        int_id=1,
        path="/a",
        rank=8,
        alpha=16.0,
        target_modules=["q_proj"],
        base_model_fingerprint="00" * 32,
    ),  # fmt: skip
    requests=2,
    first_used=START,
    last_used=START + DAY,
)


def _daily() -> list[UsageRow]:
    return [
        UsageRow(
            adapter_fingerprint=fp,
            lora_name=None,
            tenant=None,
            day=day,
            requests=n,
            prompt_tokens=0,
            generated_tokens=10 * n,
            errors=0,
        )
        for fp, day, n in (("ab" * 32, "2026-11-22", 2), (None, "2026-11-24", 1))
    ]


def test_the_page_is_self_contained_and_escaped():
    page = render_report_html(_manifest(), [ADAPTER], _daily())
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script|<link|<img|<iframe|@import|url\(|(src|href)=", page, re.IGNORECASE)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "legal&lt;qa&gt;" in page
    assert page.count("<svg") == 2  # requests and generated tokens per day
    assert "ab" * 32 in page  # the full fingerprint in the inventory
    assert "Audit log verified" in page and "cd" * 32 in page
    # three days in the window, one bar slot each, the quiet day included
    assert "11-23" in page and page.count("<rect") == 4


def test_numeric_headers_are_right_aligned_like_their_numbers():
    page = render_report_html(_manifest(), [ADAPTER], _daily())
    tenants = page[page.index("<h2>Tenants</h2>") : page.index("<h2>Finish reasons</h2>")]
    assert "<th>Tenant</th><th class='n'>Requests</th><th class='n'>Completions</th>" in tenants
    assert tenants.count('<td class="n">') == 2


def test_the_integrity_section_says_whether_and_how_the_bundle_is_signed():
    def integrity(signing):
        page = render_report_html(_manifest(), [ADAPTER], _daily(), signing)
        return page[page.index("<h2>Integrity</h2>") :]

    assert "HMAC-SHA256 with a shared key, key id <code>0123456789abcdef</code>" in integrity(
        {"algorithm": "hmac-sha256", "key_id": "0123456789abcdef"}
    )
    assert f"Ed25519, public key <code>{'ab' * 32}</code>" in integrity(
        {"algorithm": "ed25519", "public_key": "ab" * 32}
    )
    assert "unsigned" in integrity({"algorithm": "none"})
    assert "Signature" not in integrity(None)


def test_a_failed_verification_is_shown():
    verification = {
        "ok": False,
        "first_bad_sequence": 7,
        "problem": "the hash of event 7 does not match",
        "problem_count": 3,
    }
    page = render_report_html(_manifest(verification=verification), [ADAPTER], _daily())
    assert "verification FAILED at sequence 7" in page and "(2 more problems)" in page


def test_chart_colors_stay_distinct_beyond_the_palette():
    series = [(f"a{i}", PALETTE[i] if i < len(PALETTE) else f"hsl({i})", [1.0, 2.0]) for i in range(3)]
    svg = stacked_bar_svg(["2026-11-22", "2026-11-23"], series, title="t")
    assert svg.count("<rect") == 6
    ticks = re.findall(r'text-anchor="end" fill="#57606a">([^<]*)<', svg)
    assert ticks == ["0", "2", "4", "6", "8"]  # tallest bar 6: four round steps
    assert len({_color(i) for i in range(40)}) == 40


def _chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _browser() -> str:
    browser = _chromium()
    if browser is None:
        if os.environ.get("LORALEDGER_SKIP_BROWSER") == "1":
            pytest.skip("LORALEDGER_SKIP_BROWSER=1 and no Chromium installed")
        pytest.fail(
            "headless Chromium is needed to check report.html: apt-get install -y chromium "
            "(CI's .ci/run installs it), or set LORALEDGER_SKIP_BROWSER=1 to skip",
            pytrace=False,
        )
    return browser


def _report(tmp_path: Path, **signing) -> Path:
    """report.html of a synthetic log of 80 requests over 6 days."""
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    upgrade(url)
    with AuditStore(url) as store:
        build_log(store, n_requests=80, days=6)
    with AuditLog(url) as log:
        write_report(log, tmp_path / "report", since=START, until=START + 7 * DAY, progress=False, **signing)
    return tmp_path / "report" / HTML


def _chromium_run(browser: str, tmp_path: Path, page: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Chromium keeps crash reports and dconf state in the home folder, whatever --user-data-dir says: give it one under tmp
    home = tmp_path / "chromium-home"
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
    }
    result = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1200,1600",
            *args,
            page.as_uri(),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


# Measures the laid-out page and writes the figures into it as JSON, for --dump-dom to bring back.
# Added to a copy of the page only: report.html itself never holds a script.
LAYOUT_PROBE = """<script>
const text = (el) => { const r = document.createRange(); r.selectNodeContents(el); return r.getBoundingClientRect(); };
const tables = [...document.querySelectorAll("table")].filter((t) => t.tHead && t.tBodies[0] && t.tBodies[0].rows.length);
const out = {
  tables: tables.map((t) => ({
    title: (t.previousElementSibling && t.previousElementSibling.tagName === "H2") ? t.previousElementSibling.textContent : "",
    columns: [...t.tHead.rows[0].cells].map((th, i) => {
      const td = t.tBodies[0].rows[0].cells[i], h = text(th), c = text(td);
      return {head: th.textContent, numeric: td.classList.contains("n"), headLeft: h.left, headRight: h.right, cellLeft: c.left, cellRight: c.right};
    }),
  })),
  cards: [...document.querySelectorAll(".card")].map((c) => { const r = c.getBoundingClientRect(); return {top: r.top, width: r.width}; }),
  cardsWidth: document.querySelector(".cards").getBoundingClientRect().width,
};
const pre = document.createElement("pre"); pre.id = "probe"; pre.textContent = JSON.stringify(out); document.body.append(pre);
</script>"""


def test_chromium_lays_out_numbers_under_their_headers_and_cards_in_a_grid(tmp_path: Path):
    browser = _browser()
    page = _report(tmp_path, env={"LORALEDGER_REPORT_KEY": "k" * 24})
    probe_page = tmp_path / "probe.html"
    probe_page.write_text(page.read_text().replace("</body>", LAYOUT_PROBE + "</body>"))
    dom = _chromium_run(browser, tmp_path, probe_page, "--dump-dom").stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    layout = json.loads(html.unescape(found.group(1)))
    titles = [t["title"] for t in layout["tables"]]
    assert {"Adapter inventory", "Tenants", "Finish reasons", "Request outcomes"} <= set(titles)
    for table in layout["tables"]:
        for col in table["columns"]:
            if not col["head"]:
                continue  # the bar column
            if col["numeric"]:  # right-aligned numbers end where their header ends
                assert abs(col["headRight"] - col["cellRight"]) < 1.5, (table["title"], col)
            else:
                assert abs(col["headLeft"] - col["cellLeft"]) < 1.5, (table["title"], col)
    tenants = next(t for t in layout["tables"] if t["title"] == "Tenants")
    assert [c["numeric"] for c in tenants["columns"]] == [False, True, True]
    # seven summary cards of one width: the last ("tenants") does not fill a row of its own
    cards = layout["cards"]
    assert len(cards) == 7 and max(c["width"] for c in cards) - min(c["width"] for c in cards) < 1
    assert cards[-1]["width"] < layout["cardsWidth"] / 2
    # the Integrity section says how the bundle is signed
    assert "HMAC-SHA256 with a shared key, key id" in dom and hmac_key_id(b"k" * 24) in dom


def test_headless_chromium_renders_the_report(tmp_path: Path):
    browser = _browser()
    page = _report(tmp_path, unsigned=True)
    shot = tmp_path / "shot.png"
    result = _chromium_run(browser, tmp_path, page, f"--screenshot={shot}")
    assert shot.is_file(), result.stderr[-2000:]
    width, height, bpp, rows = read_png(shot.read_bytes())
    assert (width, height) == (1200, 1600)
    pixels = Counter(row[i : i + 3] for row in rows for i in range(0, len(row), bpp))
    assert len(pixels) > 200, "the screenshot has almost no colors: the page did not render"
    background_share = pixels.most_common(1)[0][1] / (width * height)
    assert background_share < 0.9, f"{background_share:.0%} of the screenshot is one color: the page looks blank"
    for color in ("#4e79a7", "#f28e2b", "#e15759"):  # the first three adapters' bars are on screen
        rgb = bytes.fromhex(color[1:])
        assert pixels[rgb] > 500, f"no {color} chart bars in the screenshot"
