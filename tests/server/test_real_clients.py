"""The clients people point at an OpenAI-compatible server, driving a live one over the tiny fixture as users do:
langchain-openai (invoke, stream, bind_tools, with_structured_output by function calling), litellm (completion and
acompletion, plain and streamed) and lm-eval-harness's `local-completions` model scoring a local multiple-choice
task by log-likelihood (echo + logprobs), its log-likelihoods checked against transformers'."""

from __future__ import annotations

import asyncio
import json
import math

import jsonschema
import pytest

from tests.server.conftest import BASE, server_config
from tests.server.live import LiveServer

CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
CLOCK_TOOL = {"type": "function", "function": {"name": "clock", "description": "the time", "parameters": CLOCK}}
MC_DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two and two make", "choices": [" four", " five"], "answer": 0},
    {"question": "Ice is", "choices": [" cold", " hot", " red", " tall"], "answer": 1},
]


@pytest.fixture(scope="module")
def server(tiny_llama_chat, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    with LiveServer(server_config(tiny_llama_chat, tmp, None, insecure_no_auth=True)) as live:
        live.tiny = tiny_llama_chat
        yield live


def test_langchain_invoke_stream_bind_tools_and_structured_output(server):
    langchain_openai = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is in the test extra: pip install -e '.[test]'"
    )
    llm = langchain_openai.ChatOpenAI(
        model="qv_r4", base_url=f"{server.base_url}/v1", api_key="unused", temperature=0, max_tokens=6,
        max_retries=0, timeout=60,
    )  # fmt: skip
    said = llm.invoke("hello")
    assert isinstance(said.content, str) and said.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in llm.stream("hello"))
    assert streamed == said.content  # greedy: the same tokens streamed or not
    forced = llm.bind_tools([CLOCK_TOOL], tool_choice="clock").bind(max_tokens=60).invoke("what time is it?")
    (call,) = forced.tool_calls
    assert call["name"] == "clock"
    jsonschema.validate(call["args"], CLOCK)
    roomy = langchain_openai.ChatOpenAI(
        model=BASE, base_url=f"{server.base_url}/v1", api_key="unused", temperature=0, max_tokens=60, max_retries=0,
        timeout=60,
    )  # fmt: skip
    structured = roomy.with_structured_output(CLOCK_TOOL, method="function_calling")
    answer = structured.invoke("what time is it in utc?")
    jsonschema.validate(answer, CLOCK)


def test_litellm_completion_and_acompletion_plain_and_streamed(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price list fetched from the network
    litellm = pytest.importorskip("litellm", reason="litellm is in the test extra: pip install -e '.[test]'")
    litellm.telemetry = False
    common = dict(
        model=f"openai/{BASE}", api_base=f"{server.base_url}/v1", api_key="unused", temperature=0, max_tokens=6,
        messages=[{"role": "user", "content": "hello"}], timeout=60, num_retries=0,
    )  # fmt: skip
    r = litellm.completion(**common)
    text = r.choices[0].message.content
    assert isinstance(text, str) and r.usage.completion_tokens >= 1
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(stream=True, **common))
    assert streamed == text

    async def both() -> tuple[str, str]:
        plain = await litellm.acompletion(**common)
        parts = []
        async for chunk in await litellm.acompletion(stream=True, **common):
            parts.append(chunk.choices[0].delta.content or "")
        return plain.choices[0].message.content, "".join(parts)

    assert asyncio.run(both()) == (text, text)


def _hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """What lm-eval computes for one (context, continuation): the continuation's tokens' log-probabilities, the
    pair tokenized as lm-eval tokenizes it (whole string, continuation = what follows the context's tokens)."""
    import torch

    ctx = tokenizer(context, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))


def test_lm_eval_local_completions_scores_a_multiple_choice_task(server, tmp_path, monkeypatch):
    for name in ("HF_HOME", "HF_DATASETS_CACHE"):  # the datasets library's cache, off $HOME
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    model_args = (
        f"model={BASE},base_url={server.base_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={server.tiny.model_dir},num_concurrent=1,max_retries=1,tokenized_requests=True"
    )
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks)), log_samples=True, batch_size=1,
    )  # fmt: skip
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == len(MC_DOCS)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.tiny.model_dir)
    model = AutoModelForCausalLM.from_pretrained(server.tiny.model_dir, dtype="float32").eval()
    correct = 0
    for sample in samples:
        scored = [resp[0][0] for resp in sample["resps"]]
        expected = [_hf_loglikelihood(model, tokenizer, *args) for args in sample["arguments"]]
        assert all(math.isfinite(x) and x < 0 for x in scored)
        assert scored == pytest.approx(expected, abs=2e-3), (sample["arguments"], scored, expected)
        correct += int(max(range(len(scored)), key=scored.__getitem__) == sample["target"])
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(correct / len(MC_DOCS))
