"""The reference helpers of tests/model_fixtures.py agree with each other: the one-forward greedy check that the
real-model tests use takes transformers + PEFT's generated tokens, and only those."""

from __future__ import annotations

from tests.model_fixtures import hf_greedy_choices, hf_reference_generate


def test_the_one_forward_greedy_check_takes_exactly_what_generate_gives(tiny_llama):
    prompts = [[5, 17, 33, 9], [40, 41], [7, 8, 9, 10, 11, 12], [100]]
    names = [None, "qv_r4", "all_r8", "ogd_r16_rslora"]
    generated = hf_reference_generate(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, 12).token_ids
    assert hf_greedy_choices(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, generated) == generated
    # one token other than the greedy one: the check names that step, and the choice the model made there
    changed = [list(ids) for ids in generated]
    changed[2][5] = (changed[2][5] + 1) % 500
    choices = hf_greedy_choices(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, changed)
    assert choices[2][5] == generated[2][5] and choices[2][:5] == changed[2][:5]
    assert [c for i, c in enumerate(choices) if i != 2] == [g for i, g in enumerate(generated) if i != 2]
