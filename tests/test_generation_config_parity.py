"""generation_config.json read without transformers against transformers' GenerationConfig (5) on the same file:
`GenerationConfig.from_pretrained(folder).to_diff_dict()`'s values for the keys the engine reads, and whether it raises,
on generated JSON objects (the sampling keys, eos_token_id, the fields validate() checks and other keys; values of
every JSON type, defaults, near-defaults, null, NaN, duplicate keys) and on files shaped like real checkpoints'; then
read_generation_config() against the code it replaced (GenerationDefaults, or a refusal where that raised)."""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path

import pytest
import transformers
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from loraledger import errors as E
from loraledger.generation_config import (
    FILE,
    SAMPLING_KEYS,
    GenerationDefaults,
    defaults_params,
    read_generation_config,
)
from loraledger.generation_config_file import (
    CACHE_IMPLEMENTATIONS,
    CLASS_NAMES,
    FIELDS,
    GENERATE_ARGUMENTS,
    MAX_CHARS,
    MAX_DEPTH,
    WATERMARK_DEFAULTS,
    GenerationConfigRefused,
    NeedsTransformers,
    depth,
    read_values,
)

GenerationConfig = transformers.GenerationConfig  # a dependency of the project: never skipped
KEYS = (*SAMPLING_KEYS, "eos_token_id")
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _transformers_diff(folder: Path) -> dict:
    with warnings.catch_warnings():  # continuous_batching_config's FutureWarning
        warnings.simplefilter("ignore")
        return GenerationConfig.from_pretrained(str(folder)).to_diff_dict()


def reference(folder: Path) -> str:
    """repr of transformers' values for KEYS (a repr tells 1, 1.0 and True apart), or "raises"."""
    try:
        diff = _transformers_diff(folder)
    except Exception:
        return "raises"
    return repr({key: diff[key] for key in KEYS if diff.get(key) is not None})


def ours(folder: Path) -> str:
    try:
        return repr(read_values(folder / FILE, KEYS))
    except GenerationConfigRefused:
        return "raises"
    except NeedsTransformers:
        return "transformers"


def replaced(folder: Path):
    """The code read_generation_config replaced (transformers' to_diff_dict): GenerationDefaults, or the exception."""
    path = folder / FILE
    try:
        diff = _transformers_diff(folder)
        sampling = {key: diff[key] for key in SAMPLING_KEYS if diff.get(key) is not None}
        if "max_new_tokens" in sampling:
            sampling["max_tokens"] = sampling.pop("max_new_tokens")
        eos = diff.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
            raise ValueError("eos_token_id")
        defaults = GenerationDefaults(sampling=sampling, eos_token_ids=tuple(eos_ids), source=str(path))
        defaults_params(defaults)
        return defaults
    except Exception as exc:
        return exc


def assert_same_defaults(folder: Path) -> GenerationDefaults | None:
    old = replaced(folder)
    try:
        new = read_generation_config(folder, "auto")
    except E.ModelLoadError as exc:
        assert isinstance(old, Exception), f"refused ({exc}) where transformers gives {old}"
        assert str(folder / FILE) in str(exc) and "generation_config='vllm'" in str(exc)
        return None
    assert not isinstance(old, Exception), f"read {new} where the transformers path raised {old!r}"
    assert (repr(new.sampling), new.eos_token_ids, new.source) == (repr(old.sampling), old.eos_token_ids, old.source)
    return new


def _odd(text: str) -> bool:
    """Whether the file holds what read_values hands to transformers: a key naming a class attribute, deep nesting."""
    data = json.loads(text)
    return any(k.startswith("__") or k in CLASS_NAMES or depth(v) > MAX_DEPTH for k, v in data.items())


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("generation-config")


def write(folder: Path, text: str | bytes) -> Path:
    path = folder / FILE
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return folder


# ---- generated files

# the keys validate() and to_dict() act on, and keys they treat specially
CHECKED = (
    "early_stopping", "max_new_tokens", "pad_token_id", "cache_implementation", "num_return_sequences", "num_beams",
    "do_sample", "suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "_from_model_config",
    "force_bos_token_to_be_generated", "bos_token_id", "assistant_ensemble_weight", "watermarking_config",
    "compile_config", "dtype", "transformers_version", "cache_config", "continuous_batching_config", "self",
    "_commit_hash", "_original_object_hash", "_mask_length", "max_length", "use_cache", "sequence_bias",
    *GENERATE_ARGUMENTS[:2],
)  # fmt: skip
NEAR_DEFAULTS = st.sampled_from(
    [0, 1, -1, 2, 3, 20, 50, 0.0, 1.0, -0.0, 0.5, 0.7, 0.95, 1.05, 1e-9, 1 - 1e-9, 1.0000001, 2**31, 2**63, 10**30,
     "never", "hybrid", "static", "paged", "lefthash", "selfhash", "float32", "1.5", "0.7", "", "null", True, False]
)  # fmt: skip
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    NEAR_DEFAULTS,
)
DICT_KEYS = st.one_of(st.sampled_from(["dtype", *WATERMARK_DEFAULTS]), st.text(max_size=5))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(DICT_KEYS, inner, max_size=3)),
    max_leaves=8,
)
# keys naming attributes of GenerationConfig's class: rare, as read_values hands such files to transformers
ODD_KEYS = sorted(CLASS_NAMES) + ["__dict__", "__class__", "__weakref__", "__doc__"]
KEY = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(CHECKED),
    st.text(min_size=0, max_size=8),
    st.sampled_from([*KEYS, *CHECKED, *ODD_KEYS[:6]]),
)
# values a real file might hold for the sampling keys and eos_token_id
PLAUSIBLE = st.one_of(
    st.floats(min_value=0, max_value=2),
    st.integers(min_value=0, max_value=200),
    st.lists(st.integers(min_value=0, max_value=10**6), max_size=3),
    NEAR_DEFAULTS,
)


@st.composite
def config_texts(draw) -> str:
    """A JSON object as text: pairs written one by one, so that a key may repeat (json.loads keeps the last)."""
    pairs = draw(st.lists(st.tuples(KEY, VALUES), max_size=8))
    if draw(st.booleans()):  # most real files set a few sampling keys: make those common
        pairs += draw(st.lists(st.tuples(st.sampled_from(KEYS), st.one_of(PLAUSIBLE, SCALARS)), max_size=4))
    order = draw(st.permutations(range(len(pairs))))
    body = ", ".join(f"{json.dumps(pairs[i][0])}: {json.dumps(pairs[i][1])}" for i in order)
    return "{" + body + "}"


@SETTINGS
@given(text=config_texts())
def test_generated_files_give_transformers_values_or_its_refusal(folder, text):
    note(text)
    write(folder, text)
    got, want = ours(folder), reference(folder)
    if got == "transformers":
        assert _odd(text), "handed to transformers a file read_values should have read"
    else:
        assert got == want


@SETTINGS
@given(text=config_texts())
def test_generated_files_give_the_replaced_codes_defaults(folder, text):
    note(text)
    assert_same_defaults(write(folder, text))


# ---- each rule, one file at a time (transformers' outcome noted: "raises" or what it reports)

CASES = [
    "{}",
    '{"temperature": "0.7"}',  # kept as the string: SamplingParams refuses it
    '{"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}',  # defaults are reported too
    '{"temperature": null, "top_k": null}',
    '{"temperature": 1, "temperature": 0.5}',
    '{"temperature": NaN, "top_p": Infinity, "min_p": -Infinity}',
    '{"temperature": 1e400}',
    '{"max_new_tokens": 0}',
    '{"max_new_tokens": false}',
    '{"max_new_tokens": true}',
    '{"max_new_tokens": "5"}',
    '{"max_new_tokens": 0.5}',
    '{"max_new_tokens": NaN}',
    '{"max_new_tokens": 512}',
    '{"early_stopping": 1.0}',
    '{"early_stopping": [1]}',
    '{"early_stopping": "never"}',
    '{"early_stopping": "x"}',
    '{"early_stopping": NaN}',
    '{"pad_token_id": "a"}',
    '{"pad_token_id": -1}',
    '{"pad_token_id": [1]}',
    '{"cache_implementation": "hybrid"}',
    '{"cache_implementation": "paged"}',
    '{"cache_implementation": "x"}',
    '{"cache_implementation": ["static"]}',
    '{"compile_config": {}}',
    '{"compile_config": null}',
    '{"watermarking_config": {}}',
    '{"watermarking_config": {"x": 1}}',
    '{"watermarking_config": {"self": 1}}',
    '{"watermarking_config": 5}',
    '{"watermarking_config": {"greenlist_ratio": "a"}}',
    '{"watermarking_config": {"greenlist_ratio": 1, "context_width": true, "seeding_scheme": "selfhash"}}',
    '{"watermarking_config": {"context_width": 0}}',
    '{"watermarking_config": {"seeding_scheme": null}}',
    '{"num_return_sequences": 2}',
    '{"num_return_sequences": 2, "do_sample": 1}',
    '{"num_return_sequences": 2, "do_sample": "no"}',
    '{"num_return_sequences": 3, "num_beams": 2}',
    '{"num_return_sequences": 2, "num_beams": true}',
    '{"num_return_sequences": 2, "num_beams": false}',
    '{"num_return_sequences": "a"}',
    '{"num_return_sequences": 2, "num_beams": "a"}',
    '{"num_return_sequences": 1.5, "num_beams": 1.0}',
    '{"suppress_tokens": 5}',
    '{"suppress_tokens": "ab", "forced_bos_token_id": "ba"}',
    '{"suppress_tokens": {"1": 2}, "forced_eos_token_id": ["1"]}',
    '{"suppress_tokens": [1], "forced_bos_token_id": 1}',
    '{"suppress_tokens": [1, 2], "forced_eos_token_id": [1, 3]}',
    '{"suppress_tokens": [1.0], "forced_eos_token_id": true}',
    '{"suppress_tokens": [NaN], "forced_eos_token_id": [NaN]}',
    '{"suppress_tokens": [[1]]}',
    '{"suppress_tokens": [1], "forced_eos_token_id": 1.5}',
    '{"suppress_tokens": [1], "forced_eos_token_id": []}',
    '{"logits_processor": 1}',
    '{"streamer": null}',
    '{"logits_processor": 1, "_from_model_config": true}',
    '{"dtype": 5}',
    '{"dtype": 1.5}',
    '{"dtype": null}',
    '{"x": {"dtype": 5}}',
    '{"x": [{"dtype": 5}]}',
    '{"x": {"dtype": {"dtype": 2}}}',
    '{"x": {"dtype": {"a.b": {"dtype": 2}}}}',
    '{"eos_token_id": {"dtype": 1.5}}',
    '{"cache_config": {"dtype": "a"}}',
    '{"transformers_version": {"dtype": 5}}',
    '{"_from_model_config": {"dtype": 5}}',
    '{"_from_model_config": true, "x": {"dtype": 5}}',
    '{"_from_model_config": true, "cache_config": {"dtype": 5}}',
    '{"_from_model_config": true, "force_bos_token_to_be_generated": true, "bos_token_id": 3, "suppress_tokens": [3]}',
    '{"_from_model_config": false, "force_bos_token_to_be_generated": true, "bos_token_id": 3, "suppress_tokens": [3]}',
    '{"self": 1}',
    '{"": 1, "a b": 2, "\\u00e9": 3, "\\ud800": 4}',
    '{"continuous_batching_config": 5}',
    '{"_commit_hash": "x", "_original_object_hash": {"dtype": 5}, "_mask_length": {"dtype": 5}}',
    '{"assistant_ensemble_weight": 1}',
    '{"assistant_ensemble_weight": 0.5}',
    '{"assistant_ensemble_weight": "a"}',
    '{"max_cache_len": "a"}',
    '{"use_cache": false, "cache_config": 1}',
    '{"top_k": true, "eos_token_id": [1, 2]}',
    '{"eos_token_id": 1.5}',
    '{"eos_token_id": "12"}',
    '{"eos_token_id": -1}',
    '{"eos_token_id": []}',
]


@pytest.mark.parametrize("text", CASES)
def test_each_rule_as_transformers_applies_it(folder, text):
    write(folder, text)
    assert ours(folder) == reference(folder)
    assert_same_defaults(folder)


@pytest.mark.parametrize(
    "text", ['{"validate": 1}', '{"get_generation_mode": 1, "temperature": 0.5}', '{"extra_output_flags": []}',
             '{"extra_output_flags": 5}', '{"__dict__": {}}', '{"__class__": 1}', '{"__foo__": 1, "top_k": 5}',
             '{"t": ' + "[" * (MAX_DEPTH + 2) + "]" * (MAX_DEPTH + 2) + ', "top_p": 0.5}',
             '{"t": ' + "[" * 100_000 + "]" * 100_000 + "}"]
)  # fmt: skip
def test_what_rests_on_transformers_own_code_is_asked_of_it(folder, text):
    """A key naming an attribute of GenerationConfig's class, a deep nesting: transformers itself reads the file."""
    write(folder, text)
    assert ours(folder) == "transformers"
    assert_same_defaults(folder)


@pytest.mark.parametrize(
    "content",
    [b"", b"   ", b"[]", b"null", b'"x"', b"1", b"{", b'{"a": 1,}', b"\xef\xbb\xbf{}", b'{"a": "\xff"}',
     b"\xff\xfe{\x00}\x00", b'{"max_new_tokens": 1' + b"0" * 5000 + b"}"],
)  # fmt: skip
def test_files_that_are_not_a_json_object_are_refused(folder, content):
    write(folder, content)
    assert ours(folder) == reference(folder) == "raises"
    with pytest.raises(E.ModelLoadError, match="fix the file or pass generation_config='vllm'"):
        read_generation_config(folder, "auto")


def test_an_absurdly_large_file_is_refused_without_reading_it_all(folder):
    write(folder, '{"x": "' + "a" * MAX_CHARS + '"}')
    with pytest.raises(E.ModelLoadError, match="characters"):
        read_generation_config(folder, "auto")
    write(folder, '{"x": "' + "a" * (MAX_CHARS - 40) + '", "top_k": 5}')  # just under: read
    assert read_generation_config(folder, "auto").sampling == {"top_k": 5}


def test_the_messages_name_the_problem(folder):
    for text, problem in [
        ("[1, 2]", "JSON list, not an object"),
        ('{"max_new_tokens": 0}', "max_new_tokens must be a number above 0, got 0"),
        ('{"cache_implementation": "x"}', "cache_implementation must be one of"),
        ('{"suppress_tokens": [1], "forced_bos_token_id": 1}', "also in suppress_tokens"),
        ('{"eos_token_id": 1.5}', "eos_token_id must be a token id or a list of them, got 1.5"),
        ('{"temperature": -3.0}', "SamplingParams refuses"),
    ]:
        write(folder, text)
        with pytest.raises(E.ModelLoadError, match=problem):
            read_generation_config(folder, "auto")


# ---- files shaped like real checkpoints'

REAL = {
    "llama-3.1-instruct": (
        {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6,
         "top_p": 0.9, "transformers_version": "4.42.3"},
        {"temperature": 0.6, "top_p": 0.9}, (128001, 128008, 128009),
    ),
    "qwen2.5-instruct": (
        {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
         "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"},
        {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}, (151645, 151643),
    ),
    "smollm2-instruct": (
        {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
         "transformers_version": "4.42.3"},
        {}, (2,),
    ),
    "gemma-2": (
        {"_from_model_config": True, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
         "pad_token_id": 0, "transformers_version": "4.42.0.dev0"},
        {}, (1,),
    ),
    "gemma-3-it": (
        {"bos_token_id": 2, "cache_implementation": "hybrid", "do_sample": True, "eos_token_id": [1, 106],
         "pad_token_id": 0, "top_k": 64, "top_p": 0.95, "transformers_version": "4.50.0.dev0"},
        {"top_k": 64, "top_p": 0.95}, (1, 106),
    ),
    "llama-2-chat": (
        {"bos_token_id": 1, "do_sample": True, "eos_token_id": 2, "max_length": 4096, "pad_token_id": 0,
         "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.31.0.dev0"},
        {"temperature": 0.6, "top_p": 0.9}, (2,),
    ),
    "phi-3": (
        {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": [32000, 32001, 32007], "pad_token_id": 32000,
         "transformers_version": "4.39.3"},
        {}, (32000, 32001, 32007),
    ),
    "whisper": (  # nested tables and long lists of extra keys; the largest real files, ~4 KB
        {"begin_suppress_tokens": [220, 50257], "bos_token_id": 50257, "decoder_start_token_id": 50258,
         "eos_token_id": 50257, "forced_decoder_ids": [[1, None], [2, 50359], [3, 50363]], "is_multilingual": True,
         "lang_to_id": {f"<|l{i}|>": 50259 + i for i in range(99)}, "max_initial_timestamp_index": 1,
         "max_length": 448, "no_timestamps_token_id": 50363, "pad_token_id": 50257, "return_timestamps": False,
         "suppress_tokens": [1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 50254, 50258, 50358, 50359, 50360, 50361, 50362],
         "task_to_id": {"transcribe": 50359, "translate": 50358}, "transformers_version": "4.31.0.dev0"},
        {}, (50257,),
    ),
    "with-max-new-tokens-and-min-p": (
        {"do_sample": True, "eos_token_id": 2, "max_new_tokens": 256, "min_p": 0.05, "temperature": 0.3},
        {"min_p": 0.05, "temperature": 0.3, "max_tokens": 256}, (2,),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_shaped_files(folder, name):
    config, sampling, eos = REAL[name]
    write(folder, json.dumps(config, indent=2) + "\n")
    assert ours(folder) == reference(folder)
    got = assert_same_defaults(folder)
    assert got is not None and got.sampling == sampling and got.eos_token_ids == eos


# ---- the lists read_values keeps, against the transformers installed


def test_the_lists_match_transformers():
    from transformers.generation import configuration_utils as cu

    instance = set(vars(GenerationConfig()))
    assert FIELDS == instance
    assert CLASS_NAMES == {name for name in dir(GenerationConfig) if not name.startswith("__")} - instance
    assert set(CACHE_IMPLEMENTATIONS) == {*cu.ALL_CACHE_IMPLEMENTATIONS, "paged"}
    params = inspect.signature(cu.WatermarkingConfig.__init__).parameters
    assert WATERMARK_DEFAULTS == {name: p.default for name, p in params.items() if name != "self"}
    assert all(value is None for key, value in GenerationConfig().to_dict().items() if key != "transformers_version")
    validate = inspect.getsource(GenerationConfig.validate)
    assert all(f'"{name}"' in validate for name in GENERATE_ARGUMENTS)
