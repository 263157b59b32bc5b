"""vLLM's prompt forms and progress bar, and skip_tokenizer_init: a model folder without tokenizer files serves token ids."""

from __future__ import annotations

import shutil

import pytest

import loraledger
from loraledger import LLM, PromptType, SamplingParams, TextPrompt, TokensPrompt
from loraledger import errors as E
from tests.api.conftest import random_prompts
from tests.model_fixtures import hf_reference_generate

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TEXT = "The quick brown fox jumps over the lazy dog"


def test_every_prompt_form_of_vllm(llama_llm, tiny_llama):
    """str, TextPrompt {"prompt"}, TokensPrompt {"prompt_token_ids"} (with or without "prompt"), and lists of them."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_llama.model_dir)(TEXT)["input_ids"]
    text_prompt: TextPrompt = {"prompt": TEXT}
    tokens_prompt: TokensPrompt = {"prompt_token_ids": ids}
    forms: list[PromptType] = [TEXT, text_prompt, tokens_prompt, {"prompt_token_ids": ids, "prompt": TEXT}]
    outs = llama_llm.generate(forms, GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids for o in outs)
    assert [o.prompt for o in outs] == [TEXT, TEXT, None, TEXT]
    assert (
        llama_llm.generate(text_prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    )
    assert {
        "TextPrompt",
        "TokensPrompt",
        "PromptType",
        "AsyncLLMEngine",
        "AsyncEngineArgs",
        "Logprob",
        "RequestStateStats",
    } <= set(dir(loraledger))


def test_use_tqdm_may_be_the_callable_that_builds_the_bar(llama_llm):
    """vLLM: use_tqdm=True shows tqdm's bar; a callable is called like tqdm to build it; each finished request advances it."""
    made = []

    class Bar:
        def __init__(self, *, total, **kwargs):
            self.total, self.kwargs, self.n, self.closed = total, kwargs, 0, False
            made.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            self.closed = True

    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, seed=100)]
    llama_llm.generate(prompts, GREEDY, use_tqdm=Bar)
    assert len(made) == 1 and made[0].total == 3 and made[0].n == 3 and made[0].closed
    assert made[0].kwargs["desc"] == "Processed prompts"
    llama_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(made) == 1


@pytest.fixture(scope="module")
def no_tokenizer(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("no-tokenizer") / "model"
    shutil.copytree(tiny_llama.model_dir, folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    return folder


def test_skip_tokenizer_init_serves_a_folder_without_tokenizer_files(no_tokenizer, tiny_llama):
    """vLLM's skip_tokenizer_init=True: token-id prompts only; outputs carry token ids and empty text."""
    with pytest.raises(E.ModelLoadError, match="skip_tokenizer_init"):
        LLM(model=str(no_tokenizer), audit_url=None)
    prompts = random_prompts(2, seed=101)
    ref = hf_reference_generate(tiny_llama.model_dir, {}, prompts, [None, None], 4, mixed=False).token_ids
    with LLM(model=str(no_tokenizer), skip_tokenizer_init=True, audit_url=None) as llm:
        assert llm.get_tokenizer() is None
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1),
            use_tqdm=False,
        )
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert all(o.outputs[0].text == "" for o in outs)
        assert all(lp.decoded_token is None for pos in outs[0].outputs[0].logprobs for lp in pos.values())
        for prompt, params, what in [
            (TEXT, GREEDY, "text prompt"),
            ({"prompt": TEXT}, GREEDY, "text prompt"),
            ({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4, stop=["x"]), "stop strings"),
            ({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4, bad_words=["x"]), "bad_words"),
        ]:
            with pytest.raises(E.NoTokenizerError, match=what):
                llm.generate(prompt, params, use_tqdm=False)
        with pytest.raises(E.NoTokenizerError, match="skip_tokenizer_init"):
            llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
        assert llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref[0]
