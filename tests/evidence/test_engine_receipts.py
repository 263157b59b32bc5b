"""Receipts from the engine: every finished output carries one, issued after its rows commit, checkable offline."""

from __future__ import annotations

import pytest

from loraledger import LLM, SamplingParams
from loraledger.evidence import receipt
from loraledger.evidence.receipt import Receipt
from loraledger.evidence.signed_note import parse_vkey
from tests.api.conftest import loras_for, random_prompts
from tests.api.test_audit_engine import engine_kwargs
from tests.evidence.test_commands import run


def test_each_finished_output_carries_a_receipt_that_checks_out(db_url, tiny_llama, tmp_path, capsys) -> None:
    from loraledger.audit.signing import generate_ed25519_key

    generate_ed25519_key(tmp_path / "log.pem")
    llm = LLM(**engine_kwargs(tiny_llama, db_url, log_key_file=str(tmp_path / "log.pem")))
    try:
        loras = loras_for(tiny_llama)
        prompts = random_prompts(4, seed=3)
        chosen = [None, loras["qv_r4"], None, loras["qv_r4"]]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=5, n=2, temperature=0.8),
                               lora_request=chosen)  # fmt: skip
    finally:
        llm.close()
    capsys.readouterr()  # the progress bar
    code, vkey = run(capsys, "audit", "vkey", "--key", str(tmp_path / "log.pem"))
    for out, lora in zip(outputs, chosen):
        assert out.receipt is not None
        held = Receipt(**out.receipt)
        log_key = parse_vkey(vkey.strip())
        body = receipt.check_signature(held, log_key)
        assert log_key.name == body["log"]
        assert body["audit_key"] == out.audit_id and body["caller_request_id"] == out.request_id
        assert (body["adapter_fingerprint"] is None) == (lora is None)
        for completion in out.outputs:
            assert receipt.matching_completion(body, completion.text) == completion.index
            digest = receipt.token_ids_sha256(list(completion.token_ids))
            assert digest in {c["token_ids_sha256"] for c in body["completions"]}
        # the log prints the same receipt, byte for byte
        code, text = run(capsys, "audit", "receipt", out.audit_id, "--url", db_url)
        assert code == 0 and receipt.load(text) == held
    code, text = run(capsys, "audit", "verify", "--url", db_url)
    assert code == 0, text


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_streamed_outputs_carry_the_receipt_on_the_last_one_only(db_url, tiny_llama, tmp_path) -> None:
    import anyio

    from loraledger import AsyncEngine, EngineArgs
    from loraledger.sampling_params import RequestOutputKind

    async def main() -> list:
        args = EngineArgs(**engine_kwargs(tiny_llama, db_url, log_key_file=None))
        async with AsyncEngine(args) as engine:
            params = SamplingParams(max_tokens=6, output_kind=RequestOutputKind.DELTA)
            return [out async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "s1")]

    chunks = anyio.run(main)
    assert chunks[-1].finished and chunks[-1].receipt is not None
    assert all(c.receipt is None for c in chunks[:-1])
    receipt.check_signature(Receipt(**chunks[-1].receipt))
