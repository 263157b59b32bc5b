"""SamplingParams and RequestOutputKind, with vLLM's names, defaults and range checks."""

from __future__ import annotations

import enum
import json
import math
from typing import Any

import msgspec

from loraledger.errors import SamplingParamsError
from loraledger.structured_outputs import StructuredOutputsParams, frozen_params

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
from loraledger.text import storable_text


class RequestOutputKind(enum.IntEnum):
    """How much of the output each streamed RequestOutput carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters of one request; out-of-range values raise SamplingParamsError (a ValueError).

    vLLM's rules, kept here: `seed=None` (or the legacy -1) is unseeded; with a seed and n > 1,
    completion i draws as a request with n=1 and seed `seed + i` would (vLLM's parallel sampling
    gives child i that seed), so each completion can be reproduced on its own; greedy sampling
    (temperature 0) allows only n=1 and resets top_p, top_k and min_p to their neutral values;
    `stop` / `stop_token_ids` / `bad_words` default to []; `logprobs=-1` / `prompt_logprobs=-1` ask
    for the whole vocabulary (the engine refuses it when its vocabulary is above
    EngineArgs.max_logprobs, unless that is -1); `logit_bias` values are clamped to [-100, 100]
    (OpenAI's range) and its keys taken as ints; stop strings need `detokenize=True`. Token ids in
    `stop_token_ids`, `logit_bias` and `allowed_token_ids` must be in the model's vocabulary, which
    the engine checks when the request arrives.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None  # None (or -1, vLLM's legacy spelling): unseeded
    max_tokens: int | None = 16
    min_tokens: int = 0  # until this many tokens exist, EOS, stop token ids and stop strings do not end the request
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # k top alternatives per output token (-1: the whole vocabulary)
    prompt_logprobs: int | None = None  # k top alternatives per prompt token (-1: the whole vocabulary)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True  # False: outputs carry token ids only (empty text)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # sample only these ids
    bad_words: list[str] = []  # words never generated (their last token is barred after the rest of them)
    extra_args: dict[str, Any] | None = None  # kept and recorded, read by nothing here (vLLM: for plugins)
    structured_outputs: StructuredOutputsParams | None = (
        None  # constrain the output to a schema, pattern, choice or grammar
    )

    def __post_init__(self) -> None:
        for name, value in _checked(self, list).items():
            setattr(self, name, value)

    def _verify(self) -> None:
        _checked(self, list)

    def frozen(
        self,
        *,
        max_n: int | None = None,
        max_logprobs: int | None = None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
    ) -> SamplingParams:
        """A checked, immutable copy: what the engine keeps of a request's parameters.

        Every value is checked again here, so a SamplingParams changed after it was built (its
        fields are plain attributes, as in vLLM) is refused with SamplingParamsError instead of
        reaching the engine; the copy's lists are tuples, its dicts its own, and the copy cannot be
        assigned to, so changing the caller's object afterwards changes nothing in the engine.
        `max_n`, `max_logprobs` (-1: the vocabulary), `vocab_size` and `max_model_len` are the engine's.
        """
        values = _checked(self, tuple)
        if max_n is not None and values["n"] > max_n:
            raise SamplingParamsError(
                f"SamplingParams.n={values['n']} is above this engine's max_n={max_n}; ask for at most {max_n} "
                "completions per request (or build the engine with a larger EngineArgs.max_n)"
            ).naming("n")
        if max_logprobs is not None:
            # vLLM's rule: -1 asks for the vocabulary, max_logprobs=-1 allows it
            limit = vocab_size if max_logprobs == -1 and vocab_size is not None else max_logprobs
            for name in ("logprobs", "prompt_logprobs"):
                asked = values[name]
                if asked == -1 and vocab_size is not None:
                    asked = vocab_size
                if asked is not None and limit != -1 and asked > limit:
                    raise SamplingParamsError(
                        f"SamplingParams.{name}={values[name]} asks for {asked} logprobs, above this engine's max_logprobs="
                        f"{max_logprobs}; ask for at most {limit} (or build the engine with a larger EngineArgs.max_logprobs; "
                        "-1 allows the whole vocabulary)"
                    ).naming(name)
        if vocab_size is not None:
            _check_vocab(values, vocab_size)
        truncate = values["truncate_prompt_tokens"]
        if max_model_len is not None and truncate is not None and truncate > max_model_len:
            raise SamplingParamsError(
                f"SamplingParams.truncate_prompt_tokens={truncate} is greater than max_model_len ({max_model_len}); "
                "select a smaller truncation size"
            ).naming("truncate_prompt_tokens")
        return _FrozenSamplingParams(**values)

    @classmethod
    def from_optional(cls, **kwargs) -> SamplingParams:
        """vLLM's constructor that skips None values (each field then takes its default)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a streamed text holds back while a stop string may still be forming (vLLM's name)."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)


class _FrozenSamplingParams(SamplingParams, frozen=True):
    """SamplingParams.frozen()'s copy: built from checked values, never assigned to afterwards."""

    def __post_init__(self) -> None:
        pass  # the values were checked (and normalised) by SamplingParams.frozen()


_INT64 = 1 << 63  # every integer must fit a signed 64-bit field (the audit log stores them as JSON numbers)
_FLAGS = (
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "detokenize",
)
_GREEDY_BELOW = 1e-5
# bounds on the work one request's lists can cause before the vocabulary is known (then: at most one entry per token)
MAX_TOKEN_LIST = 1 << 20
MAX_BAD_WORDS = 4096
MAX_BAD_WORD_CHARS = 1024
MAX_EXTRA_ARGS_BYTES = 64 << 10


def _checked(params: SamplingParams, seq_type: type) -> dict[str, object]:
    """Every field of `params`, checked and normalised (plain ints and floats; `seq_type` for the lists).

    Raises SamplingParamsError naming the field, the rule and the value.
    """
    values = {name: getattr(params, name) for name in params.__struct_fields__}

    def seq(items) -> list | tuple:
        out = seq_type(items)
        return out if out else []  # empty: the field's default, so the recorded parameters omit it

    def bad(name: str, rule: str) -> SamplingParamsError:
        return SamplingParamsError(f"SamplingParams.{name} {rule}, got {_shown(values[name])}").naming(name)

    def integer(name: str, rule: str, low: int, high: int = _INT64 - 1, *, optional: bool = False) -> None:
        value = values[name]
        if optional and value is None:
            return
        if not _is_int(value) or not low <= value <= high:
            raise bad(name, rule)
        values[name] = value if type(value) is int else int(value)

    def real(name: str, rule: str, ok) -> None:
        value = values[name]
        if not _is_real(value) or not _finite(value) or not ok(float(value)):
            raise bad(name, rule)
        values[name] = value if type(value) in (int, float) else float(value)

    if values["seed"] == -1 and _is_int(values["seed"]):
        values["seed"] = None  # vLLM's legacy spelling of "unseeded"
    for name in ("logprobs", "prompt_logprobs"):
        if values[name] is True:
            values[name] = 1  # vLLM reads logprobs=True as 1
        elif values[name] is False:
            values[name] = 0
    integer("n", "must be an integer >= 1", 1)
    real("temperature", "must be a finite number >= 0 (0 means greedy)", lambda v: v >= 0)
    real("top_p", "must be in (0, 1]", lambda v: 0 < v <= 1)
    if _is_int(values["top_k"]) and values["top_k"] == -1:
        values["top_k"] = 0
    integer("top_k", "must be an integer >= 1, or 0 / -1 to disable", 0)
    real("min_p", "must be in [0, 1]", lambda v: 0 <= v <= 1)
    integer("seed", "must be an integer in [-2**63, 2**63) or None", -_INT64, optional=True)
    integer("max_tokens", "must be an integer >= 1 (or None for up to max_model_len)", 1, optional=True)
    integer("min_tokens", "must be an integer >= 0", 0)
    if values["max_tokens"] is not None and values["min_tokens"] > values["max_tokens"]:
        raise bad("min_tokens", f"must be <= max_tokens ({values['max_tokens']})")
    stop = values["stop"]
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "must be a non-empty string or a list of non-empty strings")
    values["stop"] = seq(storable_text(s, "SamplingParams.stop: a stop string", SamplingParamsError) for s in stop)
    ids = values["stop_token_ids"]
    if ids is None:
        ids = []
    if (
        not isinstance(ids, (list, tuple))
        or len(ids) > MAX_TOKEN_LIST
        or not all(_is_int(t) and 0 <= t < _INT64 for t in ids)
    ):
        raise bad("stop_token_ids", "must be a list of token ids >= 0")
    values["stop_token_ids"] = seq(int(t) for t in ids)
    for name in ("logprobs", "prompt_logprobs"):
        integer(
            name,
            "must be an integer >= 0 (the number of top alternatives), -1 (the whole vocabulary) or None",
            -1,
            optional=True,
        )
    for name in ("presence_penalty", "frequency_penalty"):
        real(name, "must be in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
    real("repetition_penalty", "must be in (0, 100]", lambda v: 0 < v <= 100)
    for name in _FLAGS:
        if not isinstance(values[name], bool):
            raise bad(name, "must be True or False")
    kind = values["output_kind"]
    if not _is_int(kind) or kind not in RequestOutputKind._value2member_map_:
        raise bad("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
    values["output_kind"] = RequestOutputKind(kind)
    truncate = values["truncate_prompt_tokens"]
    if truncate is not None and (not _is_int(truncate) or not (truncate == -1 or 1 <= truncate < _INT64)):
        raise bad("truncate_prompt_tokens", "must be an integer >= 1 or -1 (max_model_len), or None")
    values["logit_bias"] = _logit_bias(values["logit_bias"], bad)
    allowed = values["allowed_token_ids"]
    if allowed is not None:
        if (
            not isinstance(allowed, (list, tuple))
            or not allowed
            or len(allowed) > MAX_TOKEN_LIST
            or not all(_is_int(t) and 0 <= t < _INT64 for t in allowed)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids >= 0, or None")
        values["allowed_token_ids"] = seq(int(t) for t in allowed)
    words = values["bad_words"]
    if words is None:
        words = []
    if (
        not isinstance(words, (list, tuple))
        or len(words) > MAX_BAD_WORDS
        or not all(isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in words)
    ):
        raise bad(
            "bad_words",
            f"must be a list of at most {MAX_BAD_WORDS} words, each non-blank and at most {MAX_BAD_WORD_CHARS} characters",
        )
    values["bad_words"] = seq(storable_text(w, "SamplingParams.bad_words: a word", SamplingParamsError) for w in words)
    values["extra_args"] = _extra_args(values["extra_args"], bad)
    constraint = values["structured_outputs"]
    if constraint is not None:
        if not isinstance(constraint, StructuredOutputsParams):
            raise bad(
                "structured_outputs", "must be a StructuredOutputsParams (from loraledger.sampling_params) or None"
            )
        values["structured_outputs"] = frozen_params(constraint)
    if values["stop"] and not values["detokenize"]:
        raise bad("stop", "needs detokenize=True (stop strings are matched in the text; vLLM's rule)")
    if float(values["temperature"]) < _GREEDY_BELOW:
        # vLLM's rules for greedy sampling: one completion, and top_p / top_k / min_p back to neutral
        if values["n"] > 1:
            raise SamplingParamsError(
                f"SamplingParams.n must be 1 when using greedy sampling (temperature=0), got {values['n']}"
            ).naming("n")
        values["top_p"], values["top_k"], values["min_p"] = 1.0, 0, 0.0
    return values


def _logit_bias(bias: object, bad) -> dict[int, float] | None:
    """A fresh {int token id: bias clamped to [-100, 100]} (vLLM takes int-like keys and clamps as OpenAI does)."""
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > MAX_TOKEN_LIST:
        raise bad("logit_bias", "must be a dict of token id -> bias, or None")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.strip().lstrip("-").isdigit() and len(token) < 20:
            token = int(token)  # JSON keys (an OpenAI request, or the audit log read back)
        if not _is_int(token) or not 0 <= token < _INT64:
            raise bad("logit_bias", "keys must be token ids (ints >= 0)")
        if not _is_real(value) or not _finite(value):
            raise bad("logit_bias", "values must be finite numbers")
        out[int(token)] = min(100.0, max(-100.0, float(value)))
    return out


def _extra_args(extra: object, bad) -> dict[str, Any] | None:
    """A fresh deep copy of extra_args, which must be JSON (str keys; no NaN; strings the audit log can store) and small."""
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise bad("extra_args", "must be a dict with str keys, or None")

    def plain(value: object, depth: int) -> object:
        if depth > 32:
            raise ValueError("nested too deeply")
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            if not -_INT64 <= value < _INT64:
                raise ValueError("an integer does not fit 64 bits")
            return int(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError("a number is not finite")
            return float(value)
        if isinstance(value, str):
            return storable_text(value, "a string", ValueError, allow_nul=False)
        if isinstance(value, (list, tuple)):
            return [plain(v, depth + 1) for v in value]
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise ValueError("a key is not a str")
            return {
                storable_text(k, "a key", ValueError, allow_nul=False): plain(v, depth + 1) for k, v in value.items()
            }
        raise ValueError(f"a {type(value).__name__} is not JSON")

    try:
        copied = plain(extra, 0)
        size = len(json.dumps(copied, separators=(",", ":")))
    except (ValueError, RecursionError) as exc:
        raise bad("extra_args", f"must be plain JSON data ({exc})") from None
    if size > MAX_EXTRA_ARGS_BYTES:
        raise bad("extra_args", f"must be at most {MAX_EXTRA_ARGS_BYTES} bytes as JSON ({size})")
    return copied


def _check_vocab(values: dict[str, object], vocab_size: int) -> None:
    """Token ids in the parameters must be in the vocabulary (vLLM checks logit_bias and allowed_token_ids this way)."""
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = values[name] or ()
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise SamplingParamsError(
                f"SamplingParams.{name} holds token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}"
            ).naming(name)
    bias = values["logit_bias"] or {}
    outside = [t for t in bias if t >= vocab_size]
    if outside:
        raise SamplingParamsError(
            f"SamplingParams.logit_bias: token_id(s) {outside[:5]} are out of the vocabulary; vocabulary size: {vocab_size}"
        ).naming("logit_bias")


def _shown(value: object) -> str:
    """A value for an error message: its repr, cut short (a caller's value can be of any size)."""
    try:
        text = repr(value)
    except Exception:  # a repr that raises is the caller's object's problem, not a reason to fail here
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 200 else text[:200] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: int | float) -> bool:
    """A finite float, or an int a float can hold (math.isfinite raises OverflowError on a larger one)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
