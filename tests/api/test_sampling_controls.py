"""SamplingParams' vLLM fields and rules: the token controls against transformers + PEFT, and each rule by its vLLM name."""

from __future__ import annotations

import pytest
import torch

from loraledger import LLM, SamplingParams
from loraledger import errors as E
from tests.api.conftest import loras_for, random_prompts
from tests.model_fixtures import hf_reference_generate

MAX_NEW = 8


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_NEW, "ignore_eos": True, **kw})


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _run(llm, prompts, params, loras=None):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)


def test_logit_bias_equals_transformers_sequence_bias(llama_llm, tiny_llama):
    """logit_bias adds to each listed token's logit before sampling (per adapter too): transformers' sequence_bias."""
    loras = loras_for(tiny_llama)
    names = [None, "all_r8", "qv_r4"]
    prompts = random_prompts(3, seed=80)
    plain_ref = hf_reference_generate(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, MAX_NEW, mixed=False)
    plain = plain_ref.token_ids
    bias = {plain[0][0]: -100.0, plain[1][1]: -100.0, 300: 4.0, 301: 6.0}
    ref = hf_reference_generate(
        tiny_llama.model_dir,
        tiny_llama.adapters,
        prompts,
        names,
        MAX_NEW,
        mixed=False,
        sequence_bias={(t,): b for t, b in bias.items()},
    ).token_ids
    assert ref != plain, "the bias should change the greedy output"
    outs = _run(llama_llm, prompts, _greedy(logit_bias=bias), [loras[n] if n else None for n in names])
    assert _ids(outs) == ref
    # the logprobs stay those of the raw logits (vLLM's default logprobs mode): the first token's, unbiased
    first = _run(llama_llm, prompts[:1], _greedy(logit_bias=bias, logprobs=0))[0].outputs[0]
    token = first.token_ids[0]
    raw = torch.log_softmax(plain_ref.logits[0][0], dim=-1)[token].item()
    assert first.logprobs[0][token].logprob == pytest.approx(raw, abs=1e-4)


def test_allowed_token_ids_equal_transformers_prefix_allowed_tokens(llama_llm, tiny_llama):
    """allowed_token_ids: only those ids can be sampled (transformers: prefix_allowed_tokens_fn returning them)."""
    prompts = random_prompts(2, seed=81)
    allowed = [40, 41, 42, 77, 300, 301]
    ref = hf_reference_generate(
        tiny_llama.model_dir,
        {},
        prompts,
        [None, None],
        MAX_NEW,
        mixed=False,
        prefix_allowed_tokens_fn=lambda batch, ids: allowed,
    ).token_ids
    outs = _run(llama_llm, prompts, _greedy(allowed_token_ids=allowed))
    assert _ids(outs) == ref and all(t in allowed for ids in ref for t in ids)
    # sampled rows are restricted as well
    sampled = _run(
        llama_llm,
        prompts,
        SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_NEW, ignore_eos=True, allowed_token_ids=allowed),
    )
    assert all(t in allowed for ids in _ids(sampled) for t in ids)


def _vllm_bad_words_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's SamplingParams.update_from_tokenizer, written out: each word as it starts the text, and after a space
    when that gives a different first token of the same length."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-step-at-a-time", "overlapped"])
def test_bad_words_equal_transformers_bad_words_ids(tiny_llama, async_scheduling):
    """bad_words: a word's last token is barred when the outputs end with the rest of it (a one-token word always);
    transformers' bad_words_ids with vLLM's tokenization of the words. Overlapped steps wait for the outputs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama.model_dir)
    prompts = random_prompts(3, seed=82)
    plain = hf_reference_generate(tiny_llama.model_dir, {}, prompts, [None] * 3, MAX_NEW, mixed=False).token_ids
    # words the greedy outputs write: a two-token piece of the first output, and one token of the second
    words = [tok.decode(plain[0][2:4]), tok.decode(plain[1][3:4])]
    banned = _vllm_bad_words_ids(tok, words)
    assert any(len(ids) > 1 for ids in banned), banned
    for p in prompts:  # transformers also matches the prompt's end; vLLM only the outputs: keep them apart
        assert not any(len(ids) > 1 and p[-(len(ids) - 1) :] == ids[:-1] for ids in banned)
    ref = hf_reference_generate(
        tiny_llama.model_dir, {}, prompts, [None] * 3, MAX_NEW, mixed=False, bad_words_ids=banned
    ).token_ids
    assert ref != plain
    with LLM(model=str(tiny_llama.model_dir), block_size=4, audit_url=None, async_scheduling=async_scheduling) as llm:
        outs = _run(llm, prompts, _greedy(bad_words=words))
    assert _ids(outs) == ref


def test_n_completions_with_a_seed_are_each_reproducible_alone(llama_llm, tiny_llama):
    """vLLM's parallel sampling: completion i of (n, seed=s) is what a request with n=1 and seed s + i gives."""
    prompt = {"prompt_token_ids": random_prompts(1, seed=83)[0]}
    lora = loras_for(tiny_llama)["qv_r4"]
    many = llama_llm.generate(
        prompt,
        SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=MAX_NEW, ignore_eos=True),
        lora,
        use_tqdm=False,
    )[0]
    for i, completion in enumerate(many.outputs):
        alone = llama_llm.generate(
            prompt,
            SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=MAX_NEW, ignore_eos=True),
            lora,
            use_tqdm=False,
        )[0]
        assert completion.token_ids == alone.outputs[0].token_ids


def test_sampling_params_rules_of_vllm():
    assert SamplingParams(seed=-1).seed is None  # vLLM's legacy "unseeded"
    params = SamplingParams()
    assert params.stop == [] and params.stop_token_ids == [] and params.bad_words == []
    assert SamplingParams(stop="x").stop == ["x"]
    with pytest.raises(E.SamplingParamsError, match="n must be 1 when using greedy sampling"):
        SamplingParams(temperature=0, n=2)
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=5, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)  # vLLM resets them for greedy
    assert SamplingParams(logit_bias={"7": 300, 8: -250.5}).logit_bias == {
        7: 100.0,
        8: -100.0,
    }  # int keys, OpenAI's clamp
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1
    assert SamplingParams(logprobs=True).logprobs == 1
    with pytest.raises(E.SamplingParamsError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(E.SamplingParamsError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    assert SamplingParams(extra_args={"plugin": {"k": [1, 2.5, None]}}).extra_args == {"plugin": {"k": [1, 2.5, None]}}
    assert SamplingParams.from_optional(temperature=None, top_p=0.5).temperature == 1.0


def test_logprobs_minus_one_is_the_whole_vocabulary_bounded_by_max_logprobs(tiny_llama, llama_llm):
    """vLLM: logprobs=-1 / prompt_logprobs=-1 ask for vocab_size alternatives, refused above max_logprobs unless it is -1."""
    prompt = {"prompt_token_ids": random_prompts(1, seed=84, lo=6, hi=6)[0]}
    with pytest.raises(E.SamplingParamsError, match="max_logprobs"):
        llama_llm.generate(prompt, _greedy(logprobs=-1), use_tqdm=False)
    vocab = tiny_llama.config.vocab_size
    with LLM(model=str(tiny_llama.model_dir), max_logprobs=-1, audit_url=None) as llm:
        out = llm.generate(prompt, _greedy(max_tokens=2, logprobs=-1, prompt_logprobs=-1), use_tqdm=False)[0]
    for position in out.outputs[0].logprobs:
        assert len(position) == vocab
        assert sorted(lp.rank for lp in position.values()) == list(range(1, vocab + 1))
        assert sum(torch.tensor([lp.logprob for lp in position.values()]).exp()) == pytest.approx(1.0, abs=1e-4)
    assert out.prompt_logprobs[0] is None and all(len(p) == vocab for p in out.prompt_logprobs[1:])


def test_prompt_logprobs_are_logprob_objects_with_the_prompt_tokens_rank(llama_llm, tiny_llama):
    from tests.model_fixtures import hf_reference_logits

    ids = random_prompts(1, seed=85, lo=8, hi=8)[0]
    out = llama_llm.generate({"prompt_token_ids": ids}, _greedy(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    expected = torch.log_softmax(hf_reference_logits(tiny_llama.model_dir, None, ids), dim=-1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos][ids[pos]]
        row = expected[pos - 1]
        assert entry.logprob == pytest.approx(row[ids[pos]].item(), abs=1e-4)
        assert entry.rank == int((row >= row[ids[pos]]).sum())
        top = torch.topk(row, 2).indices.tolist()
        assert [out.prompt_logprobs[pos][t].rank for t in top if t != ids[pos]] == [
            r for r, t in enumerate(top, 1) if t != ids[pos]
        ]


def test_min_tokens_also_holds_back_stop_strings(llama_llm):
    """vLLM: a stop string that ends within the first min_tokens tokens' text does not stop the request."""
    prompt = {"prompt_token_ids": random_prompts(1, seed=11)[0]}
    full = llama_llm.generate(prompt, _greedy(max_tokens=16), use_tqdm=False)[0].outputs[0]
    stop = full.text[3:6]
    first = full.text.index(stop)
    stopped = llama_llm.generate(prompt, _greedy(max_tokens=16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.text == full.text[:first] and stopped.stop_reason == stop
    # with min_tokens past the first occurrence, it runs on (to a later occurrence, or to max_tokens)
    held = llama_llm.generate(
        prompt, _greedy(max_tokens=16, stop=[stop], min_tokens=len(full.token_ids) - 2), use_tqdm=False
    )[0].outputs[0]
    assert len(held.text) > first and len(held.token_ids) >= len(full.token_ids) - 2


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_eos_that_ends_a_request_is_in_token_ids_but_not_in_the_text(llama_llm, skip_special_tokens):
    """vLLM leaves the stopping EOS out of `text` (unless include_stop_str_in_output) and keeps it in `token_ids`."""
    prompt = {"prompt_token_ids": random_prompts(1, seed=86)[0]}
    eos = 2
    params = dict(
        temperature=0, max_tokens=10, min_tokens=3, logit_bias={eos: 100.0}, skip_special_tokens=skip_special_tokens
    )
    out = llama_llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == eos and len(out.token_ids) == 4
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert "</s>" not in out.text
    kept = llama_llm.generate(prompt, SamplingParams(**params, include_stop_str_in_output=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert kept.text.endswith("</s>") == (not skip_special_tokens)


def test_detokenize_false_gives_token_ids_only(llama_llm):
    prompt = {"prompt_token_ids": random_prompts(1, seed=87)[0]}
    text = llama_llm.generate(prompt, _greedy(logprobs=1), use_tqdm=False)[0].outputs[0]
    ids = llama_llm.generate(prompt, _greedy(logprobs=1, detokenize=False), use_tqdm=False)[0].outputs[0]
    assert ids.token_ids == text.token_ids and ids.text == "" and text.text
    assert all(lp.decoded_token is None for pos in ids.logprobs for lp in pos.values())


def test_truncate_prompt_tokens_keeps_the_prompts_end_as_vllm_does(llama_llm, tiny_llama):
    """vLLM: truncate_prompt_tokens=k keeps the last k tokens (text prompts: the tokenizer's left truncation, BOS kept)."""
    from transformers import AutoTokenizer

    ids = random_prompts(1, seed=88, lo=30, hi=30)[0]
    out = llama_llm.generate({"prompt_token_ids": ids}, _greedy(truncate_prompt_tokens=10), use_tqdm=False)[0]
    direct = llama_llm.generate({"prompt_token_ids": ids[-10:]}, _greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-10:] and out.outputs[0].token_ids == direct.outputs[0].token_ids
    tok = AutoTokenizer.from_pretrained(tiny_llama.model_dir)
    tok.truncation_side = "left"
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun."
    out = llama_llm.generate(text, _greedy(truncate_prompt_tokens=8), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok(text, truncation=True, max_length=8)["input_ids"]
    assert out.prompt_token_ids[0] == tok.bos_token_id and len(out.prompt_token_ids) == 8
    # -1: max_model_len; a longer token prompt is cut to it (then too long to generate: refused, not crashed)
    with pytest.raises(E.PromptTooLongError):
        llama_llm.generate({"prompt_token_ids": [5] * 300}, _greedy(truncate_prompt_tokens=-1), use_tqdm=False)


def test_the_audit_binding_records_the_new_parameters_and_verify_passes(tiny_llama, tmp_path):
    from loraledger.audit import AuditLog

    url = f"sqlite:///{tmp_path / 'audit.db'}"
    params = _greedy(
        logit_bias={300: 2.0},
        allowed_token_ids=list(range(4, 400)),
        bad_words=["fox"],
        extra_args={"tag": "x"},
        logprobs=2,
    )
    with LLM(model=str(tiny_llama.model_dir), audit_url=url) as llm:
        out = llm.generate({"prompt_token_ids": random_prompts(1, seed=89)[0]}, params, use_tqdm=False)[0]
    with AuditLog(url) as log:
        lineage = log.request(out.audit_id)
        recorded = lineage.binding.sampling_params
        assert (
            recorded["logit_bias"] == {"300": 2.0}
            and recorded["bad_words"] == ["fox"]
            and recorded["extra_args"] == {"tag": "x"}
        )
        assert [c.token_ids for c in lineage.completions] == [out.outputs[0].token_ids]
        assert log.verify().ok


@pytest.mark.parametrize(
    "field", [{"temperature": 10**5000}, {"top_p": -(10**400)}, {"min_p": 10**309}, {"logit_bias": {5: 10**5000}}]
)
def test_an_int_too_large_for_a_float_is_a_sampling_params_error(field):
    # math.isfinite raises OverflowError on such an int: it must come back as the request's own typed error
    with pytest.raises(E.SamplingParamsError):
        SamplingParams(**field)
