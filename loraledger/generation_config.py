"""The model's generation_config.json as vLLM reads it: default sampling parameters and extra EOS ids.

vLLM (ModelConfig.get_diff_sampling_param): with generation_config="auto" the values of
repetition_penalty, temperature, top_k, top_p, min_p and max_new_tokens (as max_tokens) that the
file sets (transformers' GenerationConfig.to_diff_dict) are the default SamplingParams when a
request gives none; its eos_token_id (an int or a list) stops generation too. "vllm" ignores the
file (vLLM's documented meaning: "no generation config is loaded"); any other value names a folder
that holds a generation_config.json. The file is read as transformers' GenerationConfig reads it, without importing
transformers (loraledger/generation_config_file.py), except the odd file whose outcome rests on transformers' own code.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from loraledger.errors import ModelLoadError
from loraledger.generation_config_file import GenerationConfigRefused, NeedsTransformers, read_values

# vLLM's list, in its order; HF's max_new_tokens is vLLM's max_tokens
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
FILE = "generation_config.json"


class GenerationDefaults(msgspec.Struct, frozen=True):
    """What the engine takes from a generation config: SamplingParams defaults and EOS ids."""

    sampling: dict = {}  # SamplingParams field -> value
    eos_token_ids: tuple[int, ...] = ()
    source: str | None = None  # the file read, None when none was


def read_generation_config(model_dir: str | Path, setting: str) -> GenerationDefaults:
    """The defaults for `setting` (EngineArgs.generation_config). Raises ModelLoadError for a file that cannot be used."""
    setting = str(setting)
    if setting == "vllm":
        return GenerationDefaults()
    folder = Path(model_dir) if setting == "auto" else Path(setting)
    if setting != "auto" and not folder.is_dir():
        raise ModelLoadError(
            f"generation_config={setting!r} is neither 'auto', 'vllm' nor a folder; pass a folder holding {FILE}"
        )
    path = folder / FILE
    if not path.is_file():
        return GenerationDefaults()
    try:
        diff = read_values(path, (*SAMPLING_KEYS, "eos_token_id"))
    except GenerationConfigRefused as exc:
        raise ModelLoadError(
            f"{path} cannot be used as a generation config: {exc}; fix the file or pass generation_config='vllm'"
        ) from exc
    except NeedsTransformers:
        diff = _transformers_values(folder, path)
    sampling = {key: diff[key] for key in SAMPLING_KEYS if diff.get(key) is not None}
    if "max_new_tokens" in sampling:
        sampling["max_tokens"] = sampling.pop("max_new_tokens")
    eos = diff.get("eos_token_id")
    try:
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    except TypeError:  # a float: not a token id, nor a list of them
        eos_ids = [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
        raise ModelLoadError(
            f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}; fix the file or pass "
            "generation_config='vllm'"
        )
    defaults = GenerationDefaults(sampling=sampling, eos_token_ids=tuple(eos_ids), source=str(path))
    try:
        defaults_params(defaults)
    except Exception as exc:
        raise ModelLoadError(
            f"{path} sets sampling values SamplingParams refuses ({exc}); fix it or pass generation_config='vllm'"
        ) from exc
    return defaults


def _transformers_values(folder: Path, path: Path) -> dict:
    """to_diff_dict() of transformers' own GenerationConfig, for the files whose outcome rests on its code (a key
    naming one of its methods, a deep nesting): importing transformers costs ~21 MiB, so only those files pay it."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(folder)).to_diff_dict()
    except Exception as exc:  # transformers raises ValueError / TypeError / AttributeError / OSError for a bad file
        raise ModelLoadError(
            f"{path} cannot be read as a generation config ({type(exc).__name__}: {exc}); fix it or pass generation_config='vllm'"
        ) from exc


def defaults_params(defaults: GenerationDefaults):
    """A new SamplingParams of the defaults (vLLM's LLM.get_default_sampling_params)."""
    from loraledger.sampling_params import SamplingParams

    return SamplingParams(**defaults.sampling)
