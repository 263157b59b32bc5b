"""SamplingParams and RequestOutputKind, with vLLM's names, defaults and range checks."""

from __future__ import annotations

import enum
import math

import msgspec

from loraledger.errors import SamplingParamsError
from loraledger.text import storable_text


class RequestOutputKind(enum.IntEnum):
    """How much of the output each streamed RequestOutput carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters of one request; out-of-range values raise SamplingParamsError (a ValueError)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        for name, value in _checked(self, list).items():
            setattr(self, name, value)

    def _verify(self) -> None:
        _checked(self, list)

    def frozen(self, *, max_n: int | None = None, max_logprobs: int | None = None) -> "SamplingParams":
        """A checked, immutable copy: what the engine keeps of a request's parameters.

        Every value is checked again here, so a SamplingParams changed after it was built (its
        fields are plain attributes, as in vLLM) is refused with SamplingParamsError instead of
        reaching the engine; the copy's lists are tuples and the copy cannot be assigned to, so
        changing the caller's object afterwards changes nothing in the engine. `max_n` and
        `max_logprobs` are the engine's limits (EngineArgs).
        """
        values = _checked(self, tuple)
        if max_n is not None and values["n"] > max_n:
            raise SamplingParamsError(
                f"SamplingParams.n={values['n']} is above this engine's max_n={max_n}; ask for at most {max_n} "
                "completions per request (or build the engine with a larger EngineArgs.max_n)"
            )
        if max_logprobs is not None:
            for name in ("logprobs", "prompt_logprobs"):
                if values[name] is not None and values[name] > max_logprobs:
                    raise SamplingParamsError(
                        f"SamplingParams.{name}={values[name]} is above this engine's max_logprobs={max_logprobs}; ask for at "
                        f"most {max_logprobs} (or build the engine with a larger EngineArgs.max_logprobs)"
                    )
        return _FrozenSamplingParams(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())

    def clone(self) -> "SamplingParams":
        return msgspec.structs.replace(self)


class _FrozenSamplingParams(SamplingParams, frozen=True):
    """SamplingParams.frozen()'s copy: built from checked values, never assigned to afterwards."""

    def __post_init__(self) -> None:
        pass  # the values were checked (and normalised) by SamplingParams.frozen()


_INT64 = 1 << 63  # every integer must fit a signed 64-bit field (the audit log stores them as JSON numbers)
_FLAGS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


def _checked(params: SamplingParams, seq: type) -> dict[str, object]:
    """Every field of `params`, checked and normalised (plain ints and floats; `seq` for the lists).

    Raises SamplingParamsError naming the field, the rule and the value.
    """
    values = {name: getattr(params, name) for name in params.__struct_fields__}

    def bad(name: str, rule: str) -> SamplingParamsError:
        return SamplingParamsError(f"SamplingParams.{name} {rule}, got {_shown(values[name])}")

    def integer(name: str, rule: str, low: int, high: int = _INT64 - 1, *, optional: bool = False) -> None:
        value = values[name]
        if optional and value is None:
            return
        if not _is_int(value) or not low <= value <= high:
            raise bad(name, rule)
        values[name] = value if type(value) is int else int(value)

    def real(name: str, rule: str, ok) -> None:
        value = values[name]
        if not _is_real(value) or not math.isfinite(value) or not ok(float(value)):
            raise bad(name, rule)
        values[name] = value if type(value) in (int, float) else float(value)

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
    if stop is not None:
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        values["stop"] = seq(storable_text(s, "SamplingParams.stop: a stop string", SamplingParamsError) for s in stop)
    ids = values["stop_token_ids"]
    if ids is not None:
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t < _INT64 for t in ids):
            raise bad("stop_token_ids", "must be a list of token ids >= 0")
        values["stop_token_ids"] = seq(int(t) for t in ids)
    for name in ("logprobs", "prompt_logprobs"):
        integer(name, "must be an integer >= 0 (the number of top alternatives) or None", 0, optional=True)
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
    return values


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
