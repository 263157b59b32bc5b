"""SamplingParams and RequestOutputKind, with vLLM's names, defaults and range checks."""

from __future__ import annotations

import enum
import math

import msgspec

from loraledger.errors import SamplingParamsError


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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            self.stop = list(self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        self.output_kind = RequestOutputKind(self.output_kind)
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def bad(name: str, value: object, rule: str) -> SamplingParamsError:
            return SamplingParamsError(f"SamplingParams.{name} {rule}, got {value!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if not _is_real(self.temperature) or self.temperature < 0 or not math.isfinite(self.temperature):
            raise bad("temperature", self.temperature, "must be a finite number >= 0 (0 means greedy)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 1, or 0 / -1 to disable")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", self.seed, "must be an integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1 (or None for up to max_model_len)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise bad(name, value, "must be an integer >= 0 (the number of top alternatives) or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise bad(name, value, "must be in [-2, 2]")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100 or not math.isfinite(self.repetition_penalty):
            raise bad("repetition_penalty", self.repetition_penalty, "must be in (0, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())

    def clone(self) -> "SamplingParams":
        return msgspec.structs.replace(self)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
