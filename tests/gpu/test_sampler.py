"""Sampler: greedy and logprobs, seeded draws independent of the batch, top-k/p, min-p, penalties."""

from __future__ import annotations

import pytest
import torch

from loraledger.gpu.sampler import Sampler, SampleRow
from loraledger.scheduling.step_plan import SamplingSpec

V = 16


def _row(prompt=(1,), output=(), **spec) -> SampleRow:
    return SampleRow(SamplingSpec(**spec), list(prompt), list(output))


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_batch_is_argmax_with_raw_logprobs_and_top_alternatives():
    logits = _logits(4)
    rows = [_row(logprobs=3), _row(), _row(logprobs=0), _row(logprobs=-1)]
    out = Sampler(V, "cpu").sample(logits, rows)
    expect_lp = torch.log_softmax(logits, -1)
    assert out.token_ids == logits.argmax(-1).tolist()
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(expect_lp[i, tok].item(), abs=1e-6)
    top = torch.topk(expect_lp[0], 3)
    assert [t for t, _ in out.top_logprobs[0]] == top.indices.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert out.top_logprobs[1] is None and out.top_logprobs[2] == [] and out.top_logprobs[3] is None


def test_logprob_is_of_the_raw_logits_even_when_sampling_with_temperature_and_penalties():
    logits = _logits(2, seed=1)
    rows = [
        _row(temperature=0.7, seed=3, repetition_penalty=1.5, prompt=[0, 1, 2]),
        _row(temperature=1.3, seed=4, presence_penalty=1.0, output=[5]),
    ]
    out = Sampler(V, "cpu").sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-6)


def test_seeded_draw_depends_only_on_seed_position_and_logits_not_on_the_batch():
    sampler = Sampler(V, "cpu")
    logits = _logits(1, seed=2)[0]
    target = _row(temperature=1.0, seed=1234, output=[3, 4, 5])  # output position 3
    alone = sampler.sample(logits[None], [target]).token_ids[0]
    others = _logits(5, seed=9)
    batch_rows = [
        _row(temperature=0.8, seed=7, top_p=0.5),
        _row(),  # greedy
        target,
        _row(temperature=1.0, seed=1234, output=[3]),  # same seed, another position
        _row(temperature=1.0, seed=99, top_k=3, repetition_penalty=1.2),
    ]
    batch_logits = torch.cat([others[:2], logits[None], others[2:4]])
    assert sampler.sample(batch_logits, batch_rows).token_ids[2] == alone
    # and it is a draw: over many positions the same logits give varied tokens
    draws = sampler.sample(logits.expand(64, V), [_row(temperature=1.0, seed=1234, output=[0] * p) for p in range(64)])
    assert len(set(draws.token_ids)) > 3


def test_seeded_draws_follow_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)])
    n = 4000
    rows = [_row(temperature=1.0, seed=s, output=()) for s in range(n)]
    tokens = torch.tensor(Sampler(V, "cpu").sample(logits.expand(n, V), rows).token_ids)
    freq = torch.bincount(tokens, minlength=V)[:4].float() / n
    torch.testing.assert_close(freq, torch.softmax(logits[0, :4], -1), rtol=0, atol=0.03)


def test_top_k_1_equals_greedy():
    logits = _logits(6, seed=3)
    rows = [_row(temperature=1.5, seed=s, top_k=1) for s in range(6)]
    assert Sampler(V, "cpu").sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_only_keep_likely_tokens():
    logits = torch.tensor([[4.0, 3.5, 3.0, 2.5] + [0.0] * (V - 4)])
    sampler = Sampler(V, "cpu")
    n = 300

    def tokens(**spec):
        rows = [_row(temperature=1.0, seed=s, **spec) for s in range(n)]
        return set(sampler.sample(logits.expand(n, V), rows).token_ids)

    assert tokens(top_k=2) == {0, 1}
    probs = torch.softmax(logits[0], -1)
    assert tokens(top_p=float(probs[0]) + 1e-3) == {0, 1}  # the first token alone falls just short
    assert tokens(min_p=float(probs[2] / probs[0]) - 1e-3) == {0, 1, 2}
    assert len(tokens()) > 4


def test_repetition_penalty_uses_hf_semantics_on_prompt_and_output():
    sampler = Sampler(V, "cpu")
    logits = torch.full((1, V), -5.0)
    logits[0, :2] = torch.tensor([3.0, 2.0])
    assert sampler.sample(logits, [_row(prompt=[0], repetition_penalty=2.0)]).token_ids == [1]  # 3/2 < 2
    assert sampler.sample(logits, [_row(prompt=[7], output=[0], repetition_penalty=1.4)]).token_ids == [0]  # 3/1.4 > 2
    negative = torch.full((1, V), -5.0)
    negative[0, :2] = torch.tensor([-1.0, -1.5])
    assert sampler.sample(negative, [_row(prompt=[0], repetition_penalty=2.0)]).token_ids == [1]  # -1*2 < -1.5


def test_presence_and_frequency_penalties_count_output_tokens_only():
    sampler = Sampler(V, "cpu")
    logits = torch.full((1, V), -5.0)
    logits[0, :2] = torch.tensor([3.0, 2.0])
    assert sampler.sample(logits, [_row(prompt=[0, 0, 0], frequency_penalty=0.5)]).token_ids == [0]
    assert sampler.sample(logits, [_row(output=[0, 0, 0], frequency_penalty=0.5)]).token_ids == [1]  # 3 - 1.5
    assert sampler.sample(logits, [_row(output=[0, 0, 0], presence_penalty=0.9)]).token_ids == [0]  # 3 - 0.9
    assert sampler.sample(logits, [_row(output=[0], presence_penalty=1.1)]).token_ids == [1]


def test_noise_is_a_pure_function_of_seed_and_position():
    sampler = Sampler(V, "cpu")
    a = sampler.gumbel_noise([5, 5, 6, -1], [0, 1, 0, 0])
    b = sampler.gumbel_noise([6, 5], [0, 1])
    assert torch.equal(a[2], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert torch.isfinite(a).all()


def test_min_tokens_holds_back_stop_tokens_but_not_their_logprobs():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5], [0.0, 5.0, 1.0, 0.5]])
    spec = SamplingSpec(temperature=0.0, min_tokens=2, stop_ids=[1])
    early = SampleRow(spec=spec, prompt_token_ids=[0], output_token_ids=[2])  # 1 output so far: token 1 is held back
    late = SampleRow(spec=spec, prompt_token_ids=[0], output_token_ids=[2, 3])  # min_tokens reached
    out = Sampler(4, "cpu").sample(logits, [early, late])
    assert out.token_ids == [2, 1]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0] == pytest.approx(raw[2].item(), abs=1e-6)
