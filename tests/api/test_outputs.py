"""RequestOutput / CompletionOutput / RequestStateStats in vLLM's shapes: positional construction, attribute names."""

from __future__ import annotations

from loraledger import CompletionOutput, Logprob, LoRARequest, RequestOutput, RequestStateStats, SamplingParams
from tests.api.conftest import loras_for, random_prompts


def test_outputs_accept_positional_construction_in_vllms_field_order():
    lora = LoRARequest("a", 1, "/x")
    completion = CompletionOutput(0, "hi", [5, 6], -1.5, [{5: Logprob(-0.5, 1, "h")}, {6: Logprob(-1.0)}])
    assert (completion.index, completion.text, completion.token_ids, completion.cumulative_logprob) == (
        0,
        "hi",
        [5, 6],
        -1.5,
    )
    assert completion.logprobs[1][6] == Logprob(logprob=-1.0, rank=None, decoded_token=None)
    assert completion.routed_experts is None and completion.finish_reason is None and not completion.finished()
    stats = RequestStateStats(arrival_time=1.0)
    out = RequestOutput("r", "p", [1, 2], None, [completion], True, stats, lora, None, None, 3, kv_transfer_params=None)
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.outputs, out.finished) == (
        "r",
        "p",
        [1, 2],
        [completion],
        True,
    )
    assert (out.metrics, out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids, out.num_cached_tokens) == (
        stats,
        lora,
        None,
        None,
        3,
    )
    assert out.kv_transfer_params is None and out.multi_modal_placeholders is None


def test_metrics_carry_vllms_names_in_order(llama_llm, tiny_llama):
    lora = loras_for(tiny_llama)["qv_r4"]
    out = llama_llm.generate(
        {"prompt_token_ids": random_prompts(1, seed=110)[0]},
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        lora_request=lora,
        use_tqdm=False,
    )[0]
    m = out.metrics
    assert isinstance(m, RequestStateStats)
    assert 0 < m.arrival_time <= m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts <= m.finished_ts
    assert m.first_token_latency == m.first_token_ts - m.arrival_time
    assert m.num_generation_tokens == 5 and m.num_preemptions == 0 and not m.is_corrupted
    assert m.adapter_name == "qv_r4" and len(m.adapter_fingerprint) == 64
    assert out.encoder_prompt is None and out.encoder_prompt_token_ids is None and out.kv_transfer_params is None
