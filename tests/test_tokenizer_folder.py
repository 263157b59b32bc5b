"""Which folders read_folder takes: those AutoTokenizer (the installed transformers) reads into TokenizersBackend itself.
Every other folder is left to AutoTokenizer, and load_tokenizer gives what AutoTokenizer gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraledger.json_tokenizer import JsonTokenizer
from loraledger.tokenizer_folder import GENERIC_CLASSES, PLAIN_MODEL_TYPES, read_folder
from loraledger.tokenizer_group import load_tokenizer


def test_the_plain_model_types_keep_the_generic_class_in_transformers():
    from transformers.models.auto import tokenization_auto as auto

    generic = {"TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast", "PreTrainedTokenizer"}
    for model_type in PLAIN_MODEL_TYPES:
        registered = (auto.TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend").removesuffix("Fast")
        assert "Mistral" not in registered, model_type
        assert registered in generic or model_type not in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, model_type


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from loraledger.assets import build_tokenizer

    folder = tmp_path_factory.mktemp("folder") / "base"
    build_tokenizer(folder)
    return folder


def _copy(base: Path, dest: Path, *, model_type="llama", config=None, tokenizer=None, files=None) -> Path:
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dest / name).write_text((base / name).read_text())
    if model_type is not None:
        (dest / "config.json").write_text(json.dumps({"model_type": model_type}))
    for name, change in (("tokenizer_config.json", config), ("tokenizer.json", tokenizer)):
        if change is not None:
            (dest / name).write_text(json.dumps(change(json.loads((dest / name).read_text()))))
    for name, text in (files or {}).items():
        (dest / name).write_text(text)
    return dest


@pytest.mark.parametrize("model_type", [*sorted(PLAIN_MODEL_TYPES), None])
@pytest.mark.parametrize("declared", sorted(GENERIC_CLASSES))
def test_a_generic_folder_of_a_plain_model_type_is_read_alone(base, tmp_path, model_type, declared):
    from transformers import AutoTokenizer, TokenizersBackend

    folder = _copy(base, tmp_path / "t", model_type=model_type, config=lambda c: {**c, "tokenizer_class": declared})
    assert not isinstance(read_folder(str(folder)), str)
    assert isinstance(load_tokenizer(str(folder)), JsonTokenizer)
    assert type(AutoTokenizer.from_pretrained(folder)) is TokenizersBackend


LEFT_TO_TRANSFORMERS = {
    "qwen2 (transformers gives it Qwen2Tokenizer)": dict(model_type="qwen2"),
    "mistral": dict(model_type="mistral"),
    "a model-specific class declared": dict(config=lambda c: {**c, "tokenizer_class": "GPT2Tokenizer"}),
    "a key not reasoned about": dict(config=lambda c: {**c, "add_special_tokens_on_decode": True}),
    "remote code": dict(config=lambda c: {**c, "auto_map": {"AutoTokenizer": [None, "x.Tok"]}}),
    "split special tokens": dict(config=lambda c: {**c, "split_special_tokens": True}),
    "truncation in tokenizer.json": dict(
        tokenizer=lambda t: {
            **t,
            "truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0},
        }
    ),
    "legacy special_tokens_map.json": dict(files={"special_tokens_map.json": json.dumps({"pad_token": "<unk>"})}),
    "model-specific tokens": dict(config=lambda c: {**c, "image_token": "<s>"}),
}


@pytest.mark.parametrize("case", sorted(LEFT_TO_TRANSFORMERS))
def test_other_folders_are_left_to_autotokenizer(base, tmp_path, case):
    from loraledger.tokenizer_group import load_transformers_tokenizer

    folder = _copy(base, tmp_path / "t", **LEFT_TO_TRANSFORMERS[case])
    assert isinstance(read_folder(str(folder)), str)
    got = load_tokenizer(str(folder))
    assert not isinstance(got, JsonTokenizer)
    assert type(got) is type(load_transformers_tokenizer(str(folder)))


def test_slow_mode_and_a_broken_file_go_to_autotokenizer(base, tmp_path):
    from loraledger.errors import ModelLoadError

    assert not isinstance(load_tokenizer(str(base), mode="slow"), JsonTokenizer)
    broken = _copy(base, tmp_path / "broken", config=lambda c: {**c, "bos_token": 7})
    with pytest.raises(ModelLoadError):  # transformers' own refusal, in its words
        load_tokenizer(str(broken))
