"""A generation_config.json read the way transformers (5) reads it into a GenerationConfig, without importing transformers.

read_values() gives what `GenerationConfig.from_pretrained(folder).to_diff_dict()` reports for the keys asked for, and
refuses the files that from_pretrained raises on. Every field of a default GenerationConfig() is None, so to_diff_dict
reports each value the file sets that is not null, as json.loads made it (no coercion: "0.7" stays a string, true a
bool, 1 an int). What can make from_pretrained raise, and is checked here the way transformers checks it (the same
Python operations on the same json.loads values, so that a bool counts as a number, 1.0 == True, a string is
iterable): a file that is not UTF-8 JSON (NaN, Infinity and duplicate keys are accepted, the last one wins; an int
of over sys.get_int_max_str_digits() digits is not), a JSON value that is not an object, the few fields validate()
checks, a watermarking_config, an argument of generate() given as a field, and a non-string "dtype" that
to_dict()'s dict_dtype_to_str cannot convert. A key that names something of GenerationConfig's class (a method,
extra_output_flags, __dict__, ...) is set over it, so what follows is transformers' code's business, and so is a
nesting deep enough to meet Python's recursion limit: read_values() raises NeedsTransformers for those, and the caller
asks transformers. tests/test_generation_config_parity.py checks all of it against GenerationConfig.
"""

from __future__ import annotations

import json
from pathlib import Path

# a real generation_config.json is a few hundred bytes (Whisper's, with its language table and suppress list, ~4 KB)
MAX_CHARS = 1 << 20
# deeper than this, transformers' deepcopy / json.dumps of the values decide by the interpreter's stack; real files: 3
MAX_DEPTH = 32

# GenerationConfig.__init__'s own fields (transformers 5): taken from the file by name, never set as extra attributes;
# "_commit_hash" is dropped. tests/test_generation_config_parity.py checks the list against transformers.
FIELDS = frozenset(
    {
        "max_length", "max_new_tokens", "min_length", "min_new_tokens", "early_stopping", "max_time", "stop_strings",
        "do_sample", "num_beams", "use_mtp", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
        "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff",
        "repetition_penalty", "encoder_repetition_penalty", "length_penalty", "no_repeat_ngram_size", "bad_words_ids",
        "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
        "token_healing", "guidance_scale", "watermarking_config", "num_return_sequences", "output_attentions",
        "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate", "pad_token_id",
        "bos_token_id", "eos_token_id", "encoder_no_repeat_ngram_size", "decoder_start_token_id", "is_assistant",
        "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
        "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit", "assistant_lookbehind",
        "target_lookbehind", "assistant_ensemble_weight", "speculation_type", "compile_config", "disable_compile",
        "continuous_batching_config", "low_memory", "penalty_alpha", "dola_layers", "diversity_penalty",
        "num_beam_groups", "constraints", "force_words_ids", "prefill_chunk_size", "_from_model_config",
        "transformers_version",
    }
)  # fmt: skip
# the names GenerationConfig's class defines besides dunders (its methods, extra_output_flags): a file key of one of
# them replaces it on the instance. tests/test_generation_config_parity.py checks the list against transformers.
CLASS_NAMES = frozenset(
    {
        "_dict_from_json_file", "_get_default_generation_params", "_get_files_timestamps", "_upload_modified_files",
        "dict_dtype_to_str", "extra_output_flags", "from_dict", "from_model_config", "from_pretrained",
        "get_generation_mode", "push_to_hub", "save_pretrained", "to_dict", "to_diff_dict", "to_json_file",
        "to_json_string", "update", "validate",
    }
)  # fmt: skip
# validate(): arguments of generate() that a generation config must not hold
GENERATE_ARGUMENTS = (
    "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model", "streamer",
    "negative_prompt_ids", "negative_prompt_attention_mask",
)  # fmt: skip
# validate(): the cache implementations it accepts (static, dynamic, the deprecated static ones, "paged")
CACHE_IMPLEMENTATIONS = (
    "static", "offloaded_static", "sliding_window", "hybrid", "hybrid_chunked", "offloaded_hybrid",
    "offloaded_hybrid_chunked", "dynamic", "offloaded", "quantized", "paged",
)  # fmt: skip
# WatermarkingConfig.__init__'s parameters and defaults
WATERMARK_DEFAULTS = {
    "greenlist_ratio": 0.25,
    "bias": 2.0,
    "hashing_key": 15485863,
    "seeding_scheme": "lefthash",
    "context_width": 1,
}
# to_dict() leaves these out before converting dtypes, and writes its own version string as transformers_version
_NOT_SERIALIZED = ("_commit_hash", "_original_object_hash", "_mask_length", "transformers_version")


class NeedsTransformers(Exception):
    """The file's outcome depends on transformers' own code (the reason is the message): ask GenerationConfig."""


class GenerationConfigRefused(ValueError):
    """transformers' GenerationConfig.from_pretrained raises on this file; the message says what is wrong."""


def read_values(path: str | Path, keys: tuple[str, ...]) -> dict:
    """`{key: value}` for each of `keys` (fields of GenerationConfig) that to_diff_dict() of the file would report.

    Raises GenerationConfigRefused where from_pretrained raises, NeedsTransformers where only transformers can say."""
    data = parse(path)
    check(data)
    return {key: data[key] for key in keys if data.get(key) is not None}


def parse(path: str | Path) -> dict:
    """The file as from_pretrained reads it (a UTF-8 text, json.loads), bounded to MAX_CHARS characters."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(MAX_CHARS + 1)
    except UnicodeDecodeError as exc:
        raise GenerationConfigRefused(f"it is not UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise GenerationConfigRefused(f"it cannot be read ({exc})") from exc
    if len(text) > MAX_CHARS:
        raise GenerationConfigRefused(
            f"it holds over {MAX_CHARS} characters, far more than a generation config (a few hundred bytes)"
        )
    try:
        data = json.loads(text)
    except RecursionError as exc:
        raise NeedsTransformers("its JSON nests deeper than this interpreter parses") from exc
    except ValueError as exc:  # json.JSONDecodeError, or an int of more digits than Python converts
        raise GenerationConfigRefused(f"it is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise GenerationConfigRefused(f"it holds a JSON {type(data).__name__}, not an object of generation settings")
    return data


def check(data: dict) -> None:
    """Raise as GenerationConfig(**data) and its to_dict() raise (validate() runs twice; its checks do not change)."""
    deep = [key for key, value in data.items() if depth(value) > MAX_DEPTH]
    odd = [key for key in data if key.startswith("__") or key in CLASS_NAMES]
    if deep or odd:
        what = f"keys that name GenerationConfig's own attributes ({odd})" if odd else f"values nested deeper ({deep})"
        raise NeedsTransformers(f"its {what} make transformers' own code decide")
    if "self" in data:
        raise GenerationConfigRefused("it has a key 'self', which GenerationConfig(**values) cannot take")
    from_model_config = data.get("_from_model_config")
    extras_set = not from_model_config  # __init__ sets unknown keys as attributes only then
    _check_generation_fields(data)
    _check_watermarking(data.get("watermarking_config"))
    _check_suppressed(data, from_model_config)
    if extras_set:
        given = [key for key in GENERATE_ARGUMENTS if key in data]
        if given:
            raise GenerationConfigRefused(
                f"it sets {given}, arguments of generate(), not of a generation config; remove them"
            )
    # to_dict(): the instance's attributes (the fields, and the extra keys where set) less what it leaves out, then
    # dict_dtype_to_str, which converts a non-string "dtype" of any dict among them in place
    instance = {key: value for key, value in data.items() if key in FIELDS or extras_set}
    instance.pop("watermarking_config", None)  # an object by then, not a dict
    for key in _NOT_SERIALIZED:
        instance.pop(key, None)
    _convert_dtypes(instance)


def depth(value, limit: int = MAX_DEPTH + 1) -> int:
    """How deep lists and dicts nest in `value` (a scalar: 0), counted up to `limit`."""
    if limit <= 0 or not isinstance(value, (list, dict)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((depth(item, limit - 1) for item in items), default=0)


def _number(value) -> bool:
    """Whether validate()'s comparisons with a number work on this json.loads value (bool is an int)."""
    return isinstance(value, (int, float))


def _check_generation_fields(data: dict) -> None:
    """validate()'s checks of single fields and of num_return_sequences, which raise rather than warn."""
    early = data.get("early_stopping")
    if isinstance(early, (list, dict)) or early not in {None, True, False, "never"}:
        raise GenerationConfigRefused(f"early_stopping must be true, false or 'never', got {early!r}")
    budget = data.get("max_new_tokens")
    if budget is not None and (not _number(budget) or budget <= 0):
        raise GenerationConfigRefused(f"max_new_tokens must be a number above 0, got {budget!r}")
    weight = data.get("assistant_ensemble_weight")
    if weight is not None and (not _number(weight) or not 0.0 < weight < 1.0):
        raise GenerationConfigRefused(f"assistant_ensemble_weight must be a number in (0, 1), got {weight!r}")
    pad = data.get("pad_token_id")
    if pad is not None and not _number(pad):  # only compared with 0 (a negative one is a warning)
        raise GenerationConfigRefused(f"pad_token_id must be a token id, got {pad!r}")
    cache = data.get("cache_implementation")
    if cache is not None and cache not in CACHE_IMPLEMENTATIONS:
        raise GenerationConfigRefused(f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, got {cache!r}")
    if data.get("compile_config") is not None:
        raise GenerationConfigRefused("compile_config must be a CompileConfig object, which a JSON file cannot hold")
    returned, beams = data.get("num_return_sequences"), data.get("num_beams")
    if returned is None:
        return
    if not _number(returned):
        raise GenerationConfigRefused(f"num_return_sequences must be a number, got {returned!r}")
    if not returned > 1:
        return
    if beams is None or beams == 1:
        if not data.get("do_sample"):
            raise GenerationConfigRefused(
                f"num_return_sequences={returned!r} needs do_sample=true or num_beams above it (greedy gives one)"
            )
    elif not _number(beams) or returned > beams:
        raise GenerationConfigRefused(
            f"num_return_sequences={returned!r} must be at most num_beams (a number), got num_beams={beams!r}"
        )


def _check_watermarking(config) -> None:
    """WatermarkingConfig.from_dict(config) and its validate()."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise GenerationConfigRefused(f"watermarking_config must be an object of watermarking settings, got {config!r}")
    unknown = sorted(set(config) - set(WATERMARK_DEFAULTS))
    if unknown:
        raise GenerationConfigRefused(
            f"watermarking_config has keys WatermarkingConfig does not take: {unknown} (it takes {list(WATERMARK_DEFAULTS)})"
        )
    values = {**WATERMARK_DEFAULTS, **config}
    ratio, width = values["greenlist_ratio"], values["context_width"]
    if values["seeding_scheme"] not in ["selfhash", "lefthash"]:
        raise GenerationConfigRefused(
            f"watermarking_config's seeding_scheme must be 'selfhash' or 'lefthash', got {values['seeding_scheme']!r}"
        )
    if not _number(ratio) or not 0.0 <= ratio <= 1.0:
        raise GenerationConfigRefused(f"watermarking_config's greenlist_ratio must be in [0, 1], got {ratio!r}")
    if not _number(width) or not width >= 1:
        raise GenerationConfigRefused(f"watermarking_config's context_width must be at least 1, got {width!r}")


def _check_suppressed(data: dict, from_model_config) -> None:
    """validate(): a forced BOS / EOS token that suppress_tokens also suppresses would make every logit -inf."""
    suppress = data.get("suppress_tokens")
    if suppress is None:
        return
    try:
        suppressed = set(suppress)
    except TypeError as exc:
        raise GenerationConfigRefused(f"suppress_tokens must be a list of token ids, got {suppress!r}") from exc
    forced_bos = data.get("forced_bos_token_id")
    if from_model_config and data.get("force_bos_token_to_be_generated", False):
        forced_bos = data.get("bos_token_id")  # __init__'s old-config compatibility
    for name, forced in (("forced_bos_token_id", forced_bos), ("forced_eos_token_id", data.get("forced_eos_token_id"))):
        if forced is None:
            continue
        try:
            tokens = {forced} if isinstance(forced, int) else set(forced)
        except TypeError as exc:
            raise GenerationConfigRefused(f"{name} must be a token id or a list of them, got {forced!r}") from exc
        if tokens and tokens.issubset(suppressed):
            raise GenerationConfigRefused(
                f"every token of {name} ({forced!r}) is also in suppress_tokens, which would leave no token to "
                "generate; remove it from one of them"
            )


def _convert_dtypes(values: dict) -> None:
    """GenerationConfig.dict_dtype_to_str: a non-string "dtype" becomes the text after the first dot of str() of
    it (torch.float32 -> "float32"), in this dict and the dicts among its values, in place; one without a dot fails."""
    dtype = values.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        parts = str(dtype).split(".")
        if len(parts) < 2:
            raise GenerationConfigRefused(f"a dtype must be a type name such as 'bfloat16', got {dtype!r}")
        values["dtype"] = parts[1]
    for value in values.values():
        if isinstance(value, dict):
            _convert_dtypes(value)
