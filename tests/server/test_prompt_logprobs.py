"""Prompt tokens' logprobs over HTTP: `echo` + `logprobs` with `max_tokens: 0` (lm-eval's loglikelihood requests)
and `prompt_logprobs` in the body, both in vLLM's shapes and agreeing with the logprobs of generated tokens."""

from __future__ import annotations

import math

import httpx
from transformers import AutoTokenizer

PROMPT_IDS = [5, 17, 42, 8, 23]


def _post(live, key: str, body: dict) -> dict:
    r = httpx.post(f"{live.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_max_tokens_0_scores_a_continuation_as_its_generation_did(live, client):
    tokenizer = AutoTokenizer.from_pretrained(live.tiny.model_dir)
    greedy = client.completions.create(model="qv_r4", prompt=PROMPT_IDS, max_tokens=1, temperature=0, logprobs=1)
    g = greedy.choices[0]
    next_ids = tokenizer.encode(g.text, add_special_tokens=False)
    assert len(next_ids) == 1, next_ids

    scored = client.completions.create(
        model="qv_r4", prompt=PROMPT_IDS + next_ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == tokenizer.decode(PROMPT_IDS + next_ids)  # the prompt alone, nothing generated
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(PROMPT_IDS) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    # the last prompt token's logprob is the one the engine gave it when it generated it
    assert math.isclose(lp.token_logprobs[-1], g.logprobs.token_logprobs[0], abs_tol=1e-4)
    assert lp.tokens[-1] == g.text
    # greedy: the continuation is the most likely token, so lm-eval's is_greedy holds
    assert max(lp.top_logprobs[-1].values()) == lp.token_logprobs[-1]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_logprobs_and_generation_joins_prompt_and_completion(live, keys):
    body = _post(
        live,
        keys.acme,
        {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0},
    )
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT_IDS) + 3 and body["usage"]["completion_tokens"] == 3
    assert "".join(lp["tokens"][len(PROMPT_IDS) :]) == choice["text"][lp["text_offset"][len(PROMPT_IDS)] :]


def test_prompt_logprobs_are_returned_not_dropped(live, keys):
    body = _post(live, keys.acme, {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 2, "prompt_logprobs": 1})
    prompt_lps = body["choices"][0]["prompt_logprobs"]
    assert len(prompt_lps) == len(PROMPT_IDS) and prompt_lps[0] is None
    for token_id, entries in zip(PROMPT_IDS[1:], prompt_lps[1:]):
        assert str(token_id) in entries  # the prompt's own token, with at most one more alternative
        assert 1 <= len(entries) <= 2
        assert all(e["logprob"] <= 0 and e["rank"] >= 1 for e in entries.values())
    plain = _post(live, keys.acme, {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 2})
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_max_tokens_0_without_echo_is_400(live, keys):
    body = {"model": "tiny", "prompt": "the sea", "max_tokens": 0}
    r = httpx.post(
        f"{live.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {keys.acme}"}, timeout=60
    )
    assert r.status_code == 400 and "max_tokens" in r.text, r.text


def test_streamed_echo_with_logprobs_adds_up_to_the_unstreamed_answer(live, client):
    for model, max_tokens, n in (("tiny", 3, 1), ("qv_r4", 0, 1), ("qv_r4", 4, 2)):  # n = 2: seeded sampling
        args = dict(
            model=model,
            prompt=PROMPT_IDS,
            max_tokens=max_tokens,
            echo=True,
            logprobs=2,
            temperature=0 if n == 1 else 1,
            n=n,
            seed=7,
        )
        whole = client.completions.create(**args)
        texts, lps, finish = {}, {}, {}
        for chunk in client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                assert chunk.usage.completion_tokens == whole.usage.completion_tokens
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                got = lps.setdefault(
                    c.index, {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}
                )
                for key in got:
                    got[key] += getattr(c.logprobs, key) if c.logprobs is not None else []
                finish[c.index] = c.finish_reason or finish.get(c.index)
        for choice in whole.choices:
            lp, got = choice.logprobs, lps[choice.index]
            assert texts[choice.index] == choice.text and finish[choice.index] == choice.finish_reason
            assert got["tokens"] == lp.tokens and got["text_offset"] == lp.text_offset, (model, max_tokens)
            assert got["token_logprobs"][0] is None and lp.token_logprobs[0] is None
            assert all(
                math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got["token_logprobs"][1:], lp.token_logprobs[1:])
            )
            assert len(got["tokens"]) == len(PROMPT_IDS) + max_tokens


def test_chat_returns_prompt_logprobs_of_the_rendered_prompt(live, keys):
    r = httpx.post(
        f"{live.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0},
        headers={"Authorization": f"Bearer {keys.acme}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_lps = body["prompt_logprobs"]
    assert len(prompt_lps) == body["usage"]["prompt_tokens"] and prompt_lps[0] is None
    assert all(len(entries) == 1 for entries in prompt_lps[1:])  # top 0: the prompt's own token alone
