"""The API edge's checks: each argument a caller passes to submit, checked and copied into one Submit message."""

from __future__ import annotations

import math

import msgspec

from loraledger.actors.messages import Submit
from loraledger.errors import (
    ConfigError,
    LoRADisabledError,
    LoRARequestError,
    NoTokenizerError,
    RequestIdError,
    SamplingParamsError,
    TenantError,
)
from loraledger.input_processor.prompt import parse_prompt, prompt_cache_salt
from loraledger.lora.request import LoRARequest
from loraledger.sampling_params import SamplingParams
from loraledger.text import storable_text

MAX_ID_CHARS = 1024  # request ids and tenants: keys of the audit log


class EdgeLimits(msgspec.Struct, frozen=True):
    """What the edge checks a request against: the engine's configuration and its model's shape."""

    max_model_len: int
    vocab_size: int
    max_n: int
    max_logprobs: int
    has_tokenizer: bool
    enable_lora: bool


def check_arguments(
    request_id: object,
    prompt: object,
    params: object,
    lora_request: object,
    *,
    limits: EdgeLimits,
    audit_id: object,
    now: float,
    tenant: object = None,
    arrival_time: object = None,
    resume: bool = False,
    bound_fingerprint: str | None = None,
    chat_template_sha256: object = None,
    key_id: object = None,
    user: object = None,
) -> Submit:
    """The Submit message for these arguments (channel left unset), every one checked and copied, or the typed error
    of the first bad one, in this order: request id, tenant, sampling params, prompt, tokenizer needs, adapter,
    arrival time, audit id, chat template digest, key id and user.

    What only the model's tokenizer can tell (token ids in its vocabulary, the prompt's length in tokens, bad words) is
    check_model_inputs' at admission; the sampling params' vocabulary and length limits are checked here, because here
    is where the engine's immutable copy of them is made. `now` is the arrival time when the caller gives none.
    """
    rid = storable_text(request_id, "the request id", RequestIdError, max_chars=MAX_ID_CHARS, allow_nul=False)
    if not rid:
        raise RequestIdError("the request id is empty; give a non-empty str (or leave it out to have one made)")
    if tenant is not None:
        tenant = storable_text(tenant, "the tenant", TenantError, max_chars=MAX_ID_CHARS)
    if not isinstance(params, SamplingParams):
        raise SamplingParamsError(
            f"sampling params must be a SamplingParams, got {type(params).__name__}; build one with SamplingParams(...)"
        )
    frozen = params.frozen(
        max_n=limits.max_n,
        max_logprobs=limits.max_logprobs,
        vocab_size=limits.vocab_size,
        max_model_len=limits.max_model_len,
    )
    text, ids = parse_prompt(
        prompt, max_model_len=limits.max_model_len, truncating=frozen.truncate_prompt_tokens is not None
    )
    if not limits.has_tokenizer:
        _check_untokenized(ids is None, frozen)
    if lora_request is not None:
        _check_lora(rid, lora_request, limits.enable_lora)
    arrival = _arrival_time(arrival_time, now)
    return Submit(
        request_id=storable_text(audit_id, "the audit id", RequestIdError, max_chars=MAX_ID_CHARS, allow_nul=False),
        caller_request_id=rid,
        prompt=text,
        prompt_token_ids=ids,
        params=frozen,
        lora_request=lora_request,
        tenant=tenant,
        arrival_time=arrival,
        channel=None,
        resume=bool(resume),
        bound_fingerprint=bound_fingerprint,
        chat_template_sha256=None
        if chat_template_sha256 is None
        else storable_text(chat_template_sha256, "the chat template's sha256", ConfigError, max_chars=64),
        key_id=_caller_field(key_id, "key_id"),
        user=_caller_field(user, "user"),
        cache_salt=prompt_cache_salt(prompt),
    )


def _check_untokenized(text_prompt: bool, params: SamplingParams) -> None:
    """An engine built without a tokenizer (skip_tokenizer_init) runs token ids only."""
    needs = (
        "a text prompt" if text_prompt else "stop strings" if params.stop else "bad_words" if params.bad_words else None
    )
    if needs is not None:
        raise NoTokenizerError(
            f"{needs} needs a tokenizer, and this engine was built with skip_tokenizer_init=True; send token ids "
            "({'prompt_token_ids': [...]}) and stop on stop_token_ids"
        )


def _check_lora(rid: str, lora_request: object, enable_lora: bool) -> None:
    if not isinstance(lora_request, LoRARequest):
        raise LoRARequestError(
            f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}; "
            "use LoRARequest(lora_name, lora_int_id, lora_path)"
        )
    if not enable_lora:
        raise LoRADisabledError(
            f"request {rid!r} names adapter {lora_request.lora_name!r} but the engine was built with enable_lora=False; "
            "pass enable_lora=True to serve adapters"
        )


def _arrival_time(arrival_time: object, now: float) -> float:
    if arrival_time is None:
        return float(now)
    if isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)) or not math.isfinite(arrival_time):
        raise ConfigError(
            f"arrival_time must be a finite number of seconds (time.time()), got {type(arrival_time).__name__}"
        )
    return float(arrival_time)


def _caller_field(value: object, name: str) -> str | None:
    """The HTTP server's caller identity (key_id) and OpenAI's `user`: bounded text, or None."""
    if value is None:
        return None
    return storable_text(value, f"the {name}", TenantError, max_chars=MAX_ID_CHARS)


def check_abort_ids(request_id: object) -> list[str]:
    """abort's argument: a caller's request id (str) or a list of them."""
    if isinstance(request_id, str):
        return [request_id]
    if isinstance(request_id, (list, tuple, set, frozenset)) and all(isinstance(rid, str) for rid in request_id):
        return list(request_id)
    raise RequestIdError(f"abort takes a request id (str) or a list of them, got {type(request_id).__name__}")


def check_audit_ids(audit_ids: object) -> list[str]:
    """abort_audit_ids' argument: a list of audit keys."""
    if not isinstance(audit_ids, (list, tuple)) or not all(isinstance(k, str) for k in audit_ids):
        raise RequestIdError(f"abort_audit_ids takes a list of audit ids (str), got {type(audit_ids).__name__}")
    return list(audit_ids)


def check_lora_request(lora_request: object) -> LoRARequest:
    """The adapter argument of add_lora and get_tokenizer."""
    if not isinstance(lora_request, LoRARequest):
        raise LoRARequestError(
            f"expected a LoRARequest, got {type(lora_request).__name__}; use LoRARequest(lora_name, lora_int_id, lora_path)"
        )
    return lora_request


def check_lora_int_id(lora_int_id: object) -> int:
    """The adapter id argument of remove_lora and pin_lora."""
    if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int):
        raise LoRARequestError(f"lora_int_id must be an int, got {type(lora_int_id).__name__}")
    return int(lora_int_id)
