"""check_arguments, the API edge: each argument checked and copied into the engine's Submit, or the first bad one's error."""

from __future__ import annotations

import math

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from loraledger import LoRARequest, SamplingParams
from loraledger import errors as E
from loraledger.actors.messages import Submit
from loraledger.input_processor import (
    MAX_ID_CHARS,
    EdgeLimits,
    check_abort_ids,
    check_arguments,
    check_audit_ids,
    check_lora_int_id,
    check_lora_request,
)
from loraledger.input_processor.prompt import MAX_CHARS_PER_TOKEN

LIMITS = EdgeLimits(max_model_len=32, vocab_size=100, max_n=4, max_logprobs=5, has_tokenizer=True, enable_lora=True)
AUDIT_ID = "01a2a2a2-0000-7000-8000-000000000000"
ADAPTER = LoRARequest("sql", 1, "/adapters/sql")


def check(request_id="r1", prompt="hello", params=None, lora=None, *, limits=LIMITS, **kw) -> Submit:
    params = SamplingParams(max_tokens=4) if params is None else params
    kw.setdefault("audit_id", AUDIT_ID)
    kw.setdefault("now", 1000.0)
    return check_arguments(request_id, prompt, params, lora, limits=limits, **kw)


def test_a_good_request_becomes_the_engines_own_copy():
    params = SamplingParams(max_tokens=4, stop=["\n"])
    ids = [1, 2, 3]
    msg = check("r1", {"prompt_token_ids": ids, "prompt": "abc"}, params, ADAPTER, tenant="acme", key_id="k1", user="u")
    assert (msg.request_id, msg.caller_request_id, msg.tenant, msg.key_id, msg.user) == (
        AUDIT_ID,
        "r1",
        "acme",
        "k1",
        "u",
    )
    assert (msg.prompt, msg.prompt_token_ids, msg.lora_request, msg.arrival_time) == ("abc", [1, 2, 3], ADAPTER, 1000.0)
    assert msg.channel is None and msg.resume is False
    params.max_tokens = 9  # the caller changes its objects afterwards: the engine's copy does not move
    params.stop.append("x")
    ids.append(4)
    assert msg.params.max_tokens == 4 and list(msg.params.stop) == ["\n"] and msg.prompt_token_ids == [1, 2, 3]
    with pytest.raises(AttributeError):
        msg.params.max_tokens = 5


def test_the_arrival_time_is_now_unless_given():
    assert check(now=5.5).arrival_time == 5.5
    assert check(arrival_time=7, now=5.5).arrival_time == 7.0


BAD = [
    ("empty request id", dict(request_id=""), E.RequestIdError),
    ("request id not a str", dict(request_id=7), E.RequestIdError),
    ("request id with NUL", dict(request_id="a\x00b"), E.RequestIdError),
    ("request id too long", dict(request_id="r" * (MAX_ID_CHARS + 1)), E.RequestIdError),
    ("tenant not a str", dict(tenant=3), E.TenantError),
    ("tenant a lone surrogate", dict(tenant="\ud800"), E.TenantError),
    ("params not SamplingParams", dict(params={"max_tokens": 4}), E.SamplingParamsError),
    ("n above max_n", dict(params=SamplingParams(n=5)), E.SamplingParamsError),
    ("logprobs above max_logprobs", dict(params=SamplingParams(logprobs=6)), E.SamplingParamsError),
    ("logit_bias outside the vocabulary", dict(params=SamplingParams(logit_bias={100: 1.0})), E.SamplingParamsError),
    ("truncation above max_model_len", dict(params=SamplingParams(truncate_prompt_tokens=33)), E.SamplingParamsError),
    ("prompt of another type", dict(prompt=b"hi"), E.PromptError),
    ("unknown prompt key", dict(prompt={"text": "hi"}), E.PromptError),
    ("token ids not ints", dict(prompt={"prompt_token_ids": [1, "2"]}), E.PromptError),
    ("negative token id", dict(prompt={"prompt_token_ids": [-1]}), E.PromptError),
    ("token ids too many", dict(prompt={"prompt_token_ids": [1] * 32}), E.PromptTooLongError),
    ("text too long to fit", dict(prompt="x" * (MAX_CHARS_PER_TOKEN * 32 + 1)), E.PromptTooLongError),
    ("text prompt without tokenizer", dict(limits=EdgeLimits(32, 100, 4, 5, False, True)), E.NoTokenizerError),
    (
        "stop strings without tokenizer",
        dict(
            prompt={"prompt_token_ids": [1]},
            limits=EdgeLimits(32, 100, 4, 5, False, True),
            params=SamplingParams(stop=["x"]),
        ),
        E.NoTokenizerError,
    ),
    (
        "a list prompt (not a shape) before the tokenizer's needs",
        dict(prompt=[1], limits=EdgeLimits(32, 100, 4, 5, False, True), params=SamplingParams(stop=["x"])),
        E.PromptError,
    ),
    (
        "bad words without tokenizer",
        dict(
            prompt={"prompt_token_ids": [1]},
            limits=EdgeLimits(32, 100, 4, 5, False, True),
            params=SamplingParams(bad_words=["x"]),
        ),
        E.NoTokenizerError,
    ),
    ("adapter not a LoRARequest", dict(lora="sql"), E.LoRARequestError),
    (
        "adapter on an engine without LoRA",
        dict(lora=ADAPTER, limits=EdgeLimits(32, 100, 4, 5, True, False)),
        E.LoRADisabledError,
    ),
    ("arrival time NaN", dict(arrival_time=math.nan), E.ConfigError),
    ("arrival time a bool", dict(arrival_time=True), E.ConfigError),
    ("audit id with NUL", dict(audit_id="a\x00"), E.RequestIdError),
    ("chat template digest too long", dict(chat_template_sha256="a" * 65), E.ConfigError),
    ("key id not a str", dict(key_id=1), E.TenantError),
    ("user too long", dict(user="u" * (MAX_ID_CHARS + 1)), E.TenantError),
]


@pytest.mark.parametrize("kw, error", [(kw, error) for _, kw, error in BAD], ids=[name for name, _, _ in BAD])
def test_each_bad_argument_has_its_typed_error(kw, error):
    kw = dict(kw)
    args = {name: kw.pop(name) for name in ("request_id", "prompt", "params", "lora") if name in kw}
    with pytest.raises(error) as info:
        check(**args, **kw)
    assert type(info.value) is error and str(info.value)  # this very error, saying what is wrong


def test_the_first_bad_argument_is_the_one_named():
    with pytest.raises(E.RequestIdError):
        check("", prompt=b"not a prompt", params="not params", tenant=3)
    with pytest.raises(E.TenantError):
        check("r", prompt=b"not a prompt", params="not params", tenant=3)
    with pytest.raises(E.SamplingParamsError):
        check("r", prompt=b"not a prompt", params="not params")


def test_truncation_lets_token_ids_be_longer_than_the_model():
    params = SamplingParams(truncate_prompt_tokens=8)
    assert len(check(prompt={"prompt_token_ids": [1] * 40}, params=params).prompt_token_ids) == 40  # admission cuts


def test_the_small_argument_checks():
    assert check_abort_ids("a") == ["a"] and sorted(check_abort_ids({"a", "b"})) == ["a", "b"]
    assert check_audit_ids(("k",)) == ["k"]
    assert check_lora_request(ADAPTER) is ADAPTER and check_lora_int_id(3) == 3
    for bad in (3, ["a", 1], None):
        with pytest.raises(E.RequestIdError):
            check_abort_ids(bad)
    with pytest.raises(E.RequestIdError):
        check_audit_ids("k")
    with pytest.raises(E.LoRARequestError):
        check_lora_request({"lora_name": "sql"})
    for bad in (True, 1.0, "1"):
        with pytest.raises(E.LoRARequestError):
            check_lora_int_id(bad)


# anything a caller might pass in each position: valid values, odd ones and plainly wrong ones
ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.binary(max_size=8),
    st.lists(st.integers(min_value=-3, max_value=200), max_size=40),
)


def mostly(valid: st.SearchStrategy, odd: st.SearchStrategy = ANYTHING) -> st.SearchStrategy:
    """Four in five draws from `valid`: every argument must pass for a request to reach the checks after it."""
    return st.integers(0, 4).flatmap(lambda i: odd if i == 0 else valid)


PROMPTS = mostly(
    st.one_of(
        st.text(max_size=2000),
        st.fixed_dictionaries(
            {"prompt_token_ids": st.lists(st.integers(0, 2**63 - 1) | st.integers(0, 200), max_size=70)},
            optional={"prompt": st.text(max_size=20)},
        ),
    ),
    st.one_of(
        ANYTHING,
        st.fixed_dictionaries({"prompt_token_ids": ANYTHING}, optional={"prompt": ANYTHING}),
        st.dictionaries(st.text(max_size=20), ANYTHING, max_size=3),
    ),
)
PARAMS = mostly(
    st.builds(
        SamplingParams,
        n=st.integers(1, 6),
        logprobs=st.none() | st.integers(-1, 8),
        truncate_prompt_tokens=st.none() | st.sampled_from([-1, 1, 8, 31, 32, 33]),
        stop=st.none() | st.lists(st.text(min_size=1, max_size=4), max_size=2),
    )
)
LIMIT_SETS = st.builds(
    EdgeLimits,
    max_model_len=st.integers(2, 64),
    vocab_size=st.integers(1, 300),
    max_n=st.integers(1, 4),
    max_logprobs=st.integers(-1, 8),
    has_tokenizer=st.booleans(),
    enable_lora=st.booleans(),
)


@settings(max_examples=400, deadline=None)
@given(
    request_id=mostly(st.text(min_size=1, max_size=20)),
    prompt=PROMPTS,
    params=PARAMS,
    lora=mostly(st.sampled_from([None, ADAPTER])),
    tenant=mostly(st.none() | st.text(max_size=20)),
    arrival_time=mostly(st.none() | st.floats(allow_nan=False, allow_infinity=False)),
    limits=LIMIT_SETS,
)
def test_any_arguments_give_a_checked_copy_or_a_typed_error(
    request_id, prompt, params, lora, tenant, arrival_time, limits
):
    def run() -> Submit:
        return check(request_id, prompt, params, lora, tenant=tenant, arrival_time=arrival_time, limits=limits)

    try:
        msg = run()
    except E.LoraLedgerError as exc:
        event(f"refused: {type(exc).__name__}")
        assert str(exc)
        with pytest.raises(type(exc)):  # pure: the same arguments, the same refusal
            run()
        return
    event("accepted")
    assert msg == run()  # pure: the same arguments, the same message
    assert isinstance(msg.caller_request_id, str) and 0 < len(msg.caller_request_id) <= MAX_ID_CHARS
    assert "\x00" not in msg.caller_request_id
    assert msg.tenant is None or isinstance(msg.tenant, str)
    assert math.isfinite(msg.arrival_time)
    assert msg.params is not params and msg.params.n <= limits.max_n
    assert msg.lora_request is None or (limits.enable_lora and isinstance(msg.lora_request, LoRARequest))
    ids = msg.prompt_token_ids
    if ids is None:
        assert isinstance(msg.prompt, str) and limits.has_tokenizer
        assert len(msg.prompt) <= MAX_CHARS_PER_TOKEN * limits.max_model_len
    else:
        assert all(type(t) is int and t >= 0 for t in ids)
        if msg.params.truncate_prompt_tokens is None:
            assert len(ids) < limits.max_model_len
    if not limits.has_tokenizer:
        assert ids is not None and not msg.params.stop and not msg.params.bad_words
