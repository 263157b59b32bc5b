"""The `loraledger audit ...` commands, run through loraledger.cli.main."""

from __future__ import annotations

import csv
import io
import json

import pytest

from loraledger.cli import main
from tests.audit.synth import ADAPTERS, SynthLog, build_formula_log
from tests.audit.tampering import event_seq, tamper


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_show_prints_the_lineage(migrated_db_url: str, synth: SynthLog, capsys):
    request = next(r for r in synth.requests if len(r.completions) > 1 and r.binding.adapter_fingerprint)
    rid = request.binding.request_id
    code, out, _ = run(capsys, "audit", "show", rid, "--url", migrated_db_url)
    assert code == 0
    assert f"request {rid}  (finished)" in out
    assert request.binding.adapter_fingerprint in out
    assert f"completions ({len(request.completions)})" in out and "request_finished" in out
    code, out, _ = run(capsys, "audit", "show", rid, "--url", migrated_db_url, "--format", "json")
    data = json.loads(out)
    assert data["binding"]["request_id"] == rid and len(data["completions"]) == len(request.completions)
    code, _, err = run(capsys, "audit", "show", "nope", "--url", migrated_db_url)
    assert code == 2 and "error: " in err and "'nope'" in err


def test_requests_and_usage_listings(migrated_db_url: str, synth: SynthLog, capsys):
    name = ADAPTERS[0].name
    mine = [r for r in synth.requests if r.binding.lora_name == name]
    code, out, _ = run(capsys, "audit", "requests", "--url", migrated_db_url, "--adapter", name, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [r["request_id"] for r in rows] == [r.binding.request_id for r in mine]
    code, out, _ = run(capsys, "audit", "requests", "--url", migrated_db_url, "--limit", "3")
    assert code == 0 and out.splitlines()[0].startswith("request ") and out.rstrip().endswith("(3 rows)")
    code, out, _ = run(capsys, "audit", "requests", "--url", migrated_db_url, "--format", "jsonl", "--tenant", "acme")
    assert {json.loads(line)["tenant"] for line in out.splitlines()} == {"acme"}

    code, out, _ = run(capsys, "audit", "usage", "--url", migrated_db_url, "--by", "adapter,day", "--format", "jsonl")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and sum(x["requests"] for x in lines) == len(synth.requests)
    assert set(lines[0]) == {
        "day",
        "lora_name",
        "adapter_fingerprint",
        "requests",
        "prompt_tokens",
        "generated_tokens",
        "errors",
    }
    code, out, _ = run(capsys, "audit", "usage", "--url", migrated_db_url, "--by", "tenant")
    assert code == 0 and "acme" in out and "generated tokens" in out
    code, _, err = run(capsys, "audit", "usage", "--url", migrated_db_url, "--by", "model")
    assert code == 2 and "group_by" in err
    code, out, _ = run(capsys, "audit", "adapters", "--url", migrated_db_url)
    assert code == 0 and all(a.fingerprint in out for a in ADAPTERS)


def test_verify_checkpoint_and_tampering(migrated_db_url: str, synth: SynthLog, capsys, tmp_path):
    url = migrated_db_url
    code, out, _ = run(capsys, "audit", "verify", "--url", url)
    assert code == 0 and out.startswith("OK:") and f"head {synth.events} " in out
    head_hash = out.split()[-1]
    assert len(head_hash) == 64
    code, out, _ = run(capsys, "audit", "checkpoint", "--url", url, "--out", str(tmp_path / "cp.json"))
    assert code == 0 and json.loads((tmp_path / "cp.json").read_text())["hash"] == head_hash
    code, out, _ = run(capsys, "audit", "verify", "--url", url, "--checkpoint", str(tmp_path / "cp.json"))
    assert code == 0
    rid = next(r.binding.request_id for r in synth.requests if r.completions and r.outcome == "stop")
    bad = event_seq(url, rid, "request_finished")
    tamper(url, "UPDATE completions SET finish_reason = 'length' WHERE request_id = :r", r=rid)
    code, out, _ = run(capsys, "audit", "verify", "--url", url)
    assert code == 1 and out.startswith(f"FAILED at sequence {bad} (`completions` row request_id={rid!r}):"), out


def test_report_and_verify_report(migrated_db_url: str, synth: SynthLog, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("LORALEDGER_REPORT_KEY", raising=False)
    window = ["--since", "2026-11-22", "--until", "2026-11-24T12:00:00Z"]
    code, _, err = run(capsys, "audit", "report", "--url", migrated_db_url, *window, "--out", str(tmp_path / "r"))
    assert code == 2 and "--unsigned" in err
    code, out, _ = run(capsys, "audit", "keygen", "--out", str(tmp_path / "k.pem"), "--public", str(tmp_path / "p.pem"))
    assert code == 0
    code, out, err = run(
        capsys, "audit", "report", "--url", migrated_db_url, *window, "--out", str(tmp_path / "r"),
        "--key-file", str(tmp_path / "k.pem"), "--tenant", "globex",
    )  # fmt: skip
    assert code == 0 and "signature ed25519" in out
    assert "exporting requests: " in err  # stderr is not a terminal here: plain lines, no bar
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["filters"]["tenant"] == "globex" and manifest["window"]["until"] == "2026-11-24T12:00:00.000000Z"
    code, out, _ = run(capsys, "audit", "verify-report", str(tmp_path / "r"), "--key-file", str(tmp_path / "p.pem"))
    assert code == 0 and out.startswith("OK:")
    with open(tmp_path / "r" / "completions.csv", "a") as f:
        f.write("forged,0,globex,,stop,,1,1,,,,x\n")
    code, out, _ = run(capsys, "audit", "verify-report", str(tmp_path / "r"), "--key-file", str(tmp_path / "p.pem"))
    assert code == 1 and "completions.csv does not match its sha256" in out


def test_show_takes_what_the_listing_prints_and_says_when_a_prefix_is_ambiguous(
    migrated_db_url: str, synth: SynthLog, capsys
):
    code, out, _ = run(capsys, "audit", "requests", "--url", migrated_db_url)
    printed = [line.split()[0] for line in out.splitlines()[1:-1]]
    assert printed == [r.binding.request_id for r in synth.requests]  # whole, never cut with "…"
    for rid in printed[:3]:
        code, out, _ = run(capsys, "audit", "show", rid, "--url", migrated_db_url)
        assert code == 0 and out.startswith(f"request {rid} ")
    rid = printed[12]  # req-SEED-00012: its prefix without the last digit is shared by ten ids
    code, _, err = run(capsys, "audit", "show", rid[:-1], "--url", migrated_db_url)
    assert code == 2 and f"request id prefix {rid[:-1]!r} is ambiguous: it matches 10 requests" in err
    assert rid in err and "give more of the id" in err
    code, _, err = run(capsys, "audit", "show", "req-", "--url", migrated_db_url)
    assert code == 2 and "matches more than 10 requests" in err and ", ...)" in err
    code, _, err = run(capsys, "audit", "show", "req-%", "--url", migrated_db_url)  # LIKE wildcards are plain text here
    assert code == 2 and "'req-%' is not in the audit log" in err and not err.startswith('error: "')


def test_show_text_names_the_prompt_and_enums(migrated_db_url: str, synth: SynthLog, capsys):
    request = synth.requests[0]
    code, out, _ = run(capsys, "audit", "show", request.binding.request_id, "--url", migrated_db_url)
    assert code == 0 and json.dumps(request.binding.prompt_text) in out


def test_readable_sampling_names_the_output_kind():
    from loraledger.audit.lineage_text import readable_sampling

    assert readable_sampling({"output_kind": 2, "n": 1}) == {"output_kind": "FINAL_ONLY", "n": 1}
    assert readable_sampling({"n": 1}) == {"n": 1}


def test_verify_says_what_a_checkpoint_proved(migrated_db_url: str, synth: SynthLog, capsys, tmp_path):
    cp = tmp_path / "cp.json"
    assert run(capsys, "audit", "checkpoint", "--url", migrated_db_url, "--out", str(cp))[0] == 0
    head = json.loads(cp.read_text())
    code, out, _ = run(capsys, "audit", "verify", "--url", migrated_db_url, "--checkpoint", str(cp))
    assert code == 0
    assert f"checkpoint {cp}: event {head['sequence']} still has hash {head['hash']}" in out
    assert "the log extends it unchanged (0 events added since)" in out
    code, out, _ = run(capsys, "audit", "verify", "--url", migrated_db_url)
    assert code == 0 and "checkpoint" not in out


def test_listings_in_csv_cannot_start_a_formula_and_jsonl_stays_exact(migrated_db_url: str, capsys):
    values = build_formula_log(migrated_db_url)
    code, out, _ = run(capsys, "audit", "requests", "--url", migrated_db_url, "--format", "csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out, newline="")))
    assert [r["tenant"] for r in rows] == ["'" + v for v in values]
    code, out, _ = run(capsys, "audit", "requests", "--url", migrated_db_url, "--format", "jsonl")
    assert code == 0 and [json.loads(line)["tenant"] for line in out.splitlines()] == values
