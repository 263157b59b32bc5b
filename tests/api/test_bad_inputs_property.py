"""Property: whatever a caller sends, only that caller's request fails, and the engine goes on serving everyone else.

Hypothesis generates bad (and odd but valid) prompts, request ids, tenants, sampling values (set at
construction or changed afterwards; vLLM's logit_bias, allowed_token_ids, bad_words,
truncate_prompt_tokens, extra_args, detokenize, logprobs=-1, legacy seeds and greedy n > 1 with
values chosen for each), adapter folders (missing, corrupt, oversized, sparse 64 GiB,
wrong shapes, wrong dtypes, ...) and call shapes, and throws them at one running engine through its
three entry points (LLM.generate, LLMEngine.add_request, AsyncEngine.generate) while good requests
run. For every example: each bad call is refused with a LoraLedgerError subclass or, if it was valid
after all, served to completion; the good requests' outputs equal transformers + PEFT's greedy
reference; and each good request is on record in the audit log (binding, completion, finish event).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import struct
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import make_url, select

from loraledger import LLM, LoRARequest, SamplingParams
from loraledger import errors as E
from loraledger.sampling_params import StructuredOutputsParams
from loraledger.store.audit_store import COMPLETIONS, EVENTS, REQUESTS, AuditStore
from loraledger.store.records import EventKind
from tests.api.conftest import loras_for, random_prompts
from tests.db_fixtures import _libpq
from tests.model_fixtures import hf_reference_generate

MAX_EXAMPLES = int(os.environ.get("LORALEDGER_FUZZ_EXAMPLES", "100"))  # per audit dialect
GOOD_PROMPTS = random_prompts(3, seed=42)
GOOD_ADAPTERS = [None, "qv_r4", "all_r8"]
GOOD_TOKENS = 6
ENTRIES = ["LLM.generate", "LLMEngine.add_request", "AsyncEngine.generate"]
SAMPLING_FIELDS = list(SamplingParams.__struct_fields__)


@dataclass
class Env:
    llm: LLM
    url: str
    root: Path
    reference: list[list[int]]
    loras: dict[str, LoRARequest]
    ids: itertools.count = field(default_factory=lambda: itertools.count(1000))
    outcomes: Counter = field(default_factory=Counter)  # "refused: <Error>" / "served" per bad call
    finished_ids: list[str] = field(default_factory=list)
    adapter_source: Path | None = None  # a good adapter folder the damaged ones are copied from


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def env(request, tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs")
    pg_name = None
    if request.param == "sqlite":
        url = f"sqlite:///{root / 'audit.db'}"
    else:
        admin_url = request.getfixturevalue("pg_admin_url")
        pg_name = f"loraledger_fuzz_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(_libpq(admin_url), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{pg_name}"')
        url = make_url(admin_url).set(database=pg_name).render_as_string(hide_password=False)
    reference = hf_reference_generate(
        tiny_llama.model_dir, tiny_llama.adapters, GOOD_PROMPTS, GOOD_ADAPTERS, GOOD_TOKENS, mixed=False
    ).token_ids
    llm = LLM(
        model=str(tiny_llama.model_dir),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        block_size=4,
        max_model_len=64,
        max_n=4,
        audit_url=url,
        seed=0,
    )
    environment = Env(
        llm=llm,
        url=url,
        root=root,
        reference=reference,
        loras=loras_for(tiny_llama),
        adapter_source=tiny_llama.adapters["qv_r4"],
    )
    try:
        yield environment
    finally:
        llm.close()
        total = sum(environment.outcomes.values())
        print(
            f"\nbad-input property test ({request.param}): {total} calls, {dict(sorted(environment.outcomes.items()))}"
        )
        if pg_name is not None:
            with psycopg.connect(_libpq(admin_url), autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{pg_name}" WITH (FORCE)')


# ---- strategies ---------------------------------------------------------------------------------

surrogate = st.integers(0xD800, 0xDFFF).map(chr)
with_surrogate = st.builds(lambda a, s, b: a + s + b, st.text(max_size=6), surrogate, st.text(max_size=6))
# built, not st.just: hypothesis writes a strategy's repr (a filter's retry event), and a 5,000-digit int has none
HUGE_INT = st.builds(lambda: 10**5000)
any_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    with_surrogate,
    st.binary(max_size=4),
    st.lists(st.one_of(st.integers(-5, 2**70), st.text(max_size=3)), max_size=3),
    st.sampled_from([-1, 0, 1, 2, 1e-9, 1e308, -0.0, object()]),
    HUGE_INT,
)
token_id = st.one_of(
    st.integers(-3, 600),
    st.integers(2**31, 2**70),
    HUGE_INT,
    st.booleans(),
    st.text(max_size=2),
    st.floats(),
    st.none(),
)
prompts = st.one_of(
    with_surrogate,
    st.text(max_size=30),  # odd but valid text: NUL, emoji, combining marks, ...
    st.just(""),
    st.integers(),
    st.floats(),
    st.none(),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(token_id, max_size=70)}),
    st.fixed_dictionaries(
        {"prompt_token_ids": st.lists(st.integers(4, 511), min_size=1, max_size=8), "prompt": any_value}
    ),
    st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), any_value, max_size=3),
)
request_ids = st.one_of(
    st.integers(),
    st.floats(),
    st.binary(max_size=4),
    st.just(""),
    with_surrogate,
    st.builds(lambda a, b: a + "\x00" + b, st.text(max_size=4), st.text(max_size=4)),
    st.integers(1025, 3000).map(lambda n: "x" * n),
    st.lists(st.text(max_size=2), max_size=2),
)
tenants = st.one_of(
    st.integers(),
    st.floats(),
    st.binary(max_size=3),
    with_surrogate,
    st.text(max_size=20),
    st.integers(1025, 2000).map(lambda n: "t" * n),
    st.lists(st.integers(), max_size=2),
)
sampling = st.tuples(st.sampled_from(SAMPLING_FIELDS), any_value, st.sampled_from(["mutate", "construct"]))


def _deep(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


# vLLM's fields, with the values that are bad (or odd but valid) for each in particular
nested = st.recursive(
    st.one_of(st.none(), st.integers(), st.text(max_size=3)), lambda inner: st.lists(inner, max_size=2), max_leaves=40
)
VLLM_FIELD_VALUES = {
    "logit_bias": st.dictionaries(
        st.one_of(token_id, st.sampled_from(["7", "-1", "x", " 12"])),
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70), st.text(max_size=2)),
        max_size=4,
    ),
    "allowed_token_ids": st.lists(token_id, max_size=5),
    "bad_words": st.lists(
        st.one_of(st.text(max_size=6), with_surrogate, st.integers(), st.just(""), st.just(" "), st.just("x" * 2000)),
        max_size=3,
    ),
    "truncate_prompt_tokens": st.one_of(st.integers(-5, 200), st.just(10**30)),
    "extra_args": st.one_of(
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), st.one_of(any_value, nested), max_size=3),
        st.just({"deep": _deep(40)}),
        st.just({"big": "x" * 100_000}),
        st.just({"nul": "a\x00b"}),
    ),
    "detokenize": any_value,
    "logprobs": st.integers(-3, 600),
    "prompt_logprobs": st.integers(-3, 600),
    "seed": st.sampled_from([-1, -2, 2**64, None]),
    "n": st.integers(2, 5),  # greedy (the base parameters) allows n=1 only
    "stop": st.sampled_from([[], None, ["x"], "x"]),
    "stop_token_ids": st.lists(token_id, max_size=3),
    # constraints that are well-formed but do not compile (refused at admission, for that request only), or odd but valid
    "structured_outputs": st.sampled_from(
        [
            ("regex", "(a"),
            ("regex", "a{5,2}"),
            ("grammar", "root ::= nowhere"),
            ("grammar", 'root ::= "a" |'),
            ("json", {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}),
            ("json", {"type": "nonsense"}),
            ("choice", ["\x00", "\u00e9\U0001f600"]),
            ("json_object", True),
        ]
    ).map(lambda kv: StructuredOutputsParams(**{kv[0]: kv[1]})),
}
vllm_sampling = st.one_of(
    *[
        st.tuples(st.just(name), values, st.sampled_from(["mutate", "construct"]))
        for name, values in VLLM_FIELD_VALUES.items()
    ]
)
ADAPTER_DAMAGE = [
    "missing_dir",
    "not_a_dir",
    "no_config",
    "config_not_json",
    "config_array",
    "config_huge",
    "config_rank",
    "no_weights",
    "weights_is_dir",
    "empty_weights",
    "truncated",
    "garbage",
    "header_len_huge",
    "header_not_json",
    "header_entry_bad",
    "wrong_shape",
    "rank_too_big",
    "dtype_int8",
    "trailing_bytes",
    "sparse_64g",
    "nan_weight",
    "overlapping",
    "bin_only",
]
adapters = st.tuples(st.sampled_from(ADAPTER_DAMAGE), st.integers(0, 2**31), st.binary(min_size=1, max_size=64))
lora_values = st.one_of(
    st.text(max_size=5),
    st.integers(),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just(("a", 1, "/x")),
)
call_shapes = st.sampled_from(
    [
        "params_list_short",
        "params_list_wrong_type",
        "lora_list_short",
        "prompts_int",
        "prompts_bytes",
        "prompts_set",
        "duplicate_in_flight",
        "duplicate_finished",
        "abort_int",
        "abort_mixed",
        "add_lora_str",
        "remove_lora_str",
        "pin_lora_float",
        "arrival_nan",
        "arrival_str",
        "generate_empty_list",
    ]
)
attacks = st.one_of(
    st.tuples(st.just("prompt"), prompts),
    st.tuples(st.just("request_id"), request_ids),
    st.tuples(st.just("tenant"), tenants),
    st.tuples(st.just("sampling"), sampling),
    st.tuples(st.just("sampling"), vllm_sampling),
    st.tuples(st.just("adapter"), adapters),
    st.tuples(st.just("lora_value"), lora_values),
    st.tuples(st.just("call_shape"), call_shapes),
)


# ---- the property -------------------------------------------------------------------------------


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(attack_list=st.lists(st.tuples(attacks, st.sampled_from(ENTRIES)), min_size=1, max_size=3))
def test_bad_inputs_never_stop_the_engine_or_change_good_outputs(env, attack_list):
    engine = env.llm.llm_engine
    tag = uuid.uuid4().hex[:10]
    good = {f"good-{tag}-{i}": i for i in range(len(GOOD_PROMPTS))}
    for rid, i in good.items():  # good requests in flight while the bad ones arrive
        lora = env.loras[GOOD_ADAPTERS[i]] if GOOD_ADAPTERS[i] else None
        engine.add_request(
            rid,
            {"prompt_token_ids": GOOD_PROMPTS[i]},
            SamplingParams(temperature=0, max_tokens=GOOD_TOKENS, ignore_eos=True),
            lora,
        )
    extra: set[str] = set()  # bad-looking requests that were valid after all, now in flight
    for (kind, payload), entry in attack_list:
        _attack(env, kind, payload, entry, good, extra)

    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for rid, i in good.items():
        assert finals[rid].outputs[0].finish_reason == "length"
        assert finals[rid].outputs[0].token_ids == env.reference[i], f"good request {i} changed"
    for rid in extra:  # a valid odd request is served, not failed after admission
        assert rid in finals and all(c.finish_reason != "error" for c in finals[rid].outputs), engine.errors.get(rid)
    _assert_on_record(env.url, list(good))
    env.finished_ids.extend(good)


def _assert_on_record(url: str, request_ids: list[str]) -> None:
    """Each of these caller ids (unique here) has one binding, its completion and its finished event."""
    with AuditStore(url) as store:
        with store.engine.connect() as conn:
            keys = dict(
                conn.execute(
                    select(REQUESTS.c.request_id, REQUESTS.c.caller_request_id).where(
                        REQUESTS.c.caller_request_id.in_(request_ids)
                    )
                ).all()
            )
            bound = set(keys.values())
            rows = Counter(
                keys[k]
                for k in conn.execute(
                    select(COMPLETIONS.c.request_id).where(COMPLETIONS.c.request_id.in_(keys))
                ).scalars()
            )
            ended = {
                keys[k]
                for k in conn.execute(
                    select(EVENTS.c.request_id).where(
                        EVENTS.c.request_id.in_(keys), EVENTS.c.kind == EventKind.REQUEST_FINISHED
                    )
                ).scalars()
            }
    for rid in request_ids:
        assert rid in bound and rows[rid] == 1 and rid in ended, f"{rid} is not on record"


def _attack(env: Env, kind: str, payload, entry: str, good: dict[str, int], extra: set[str]) -> None:
    """One bad call: refused with a typed error, or (valid after all) accepted and served."""
    prompt, params, lora, rid, tenant = {"prompt_token_ids": GOOD_PROMPTS[0]}, None, None, None, None
    if kind == "prompt":
        prompt = payload
    elif kind == "request_id":
        rid = payload
    elif kind == "tenant":
        tenant = payload
    elif kind == "sampling":
        try:
            params = _sampling(*payload)
        except E.SamplingParamsError:
            env.outcomes["refused: SamplingParamsError (construction)"] += 1
            return
    elif kind == "adapter":
        lora = _damaged_adapter(env, *payload)
    elif kind == "lora_value":
        lora = payload
    elif kind == "call_shape":
        _call_shape(env, payload, good)
        return
    try:
        accepted = _submit(env, entry, prompt, params, lora, rid, tenant)
    except E.LoraLedgerError as exc:
        env.outcomes[f"refused: {type(exc).__name__}"] += 1
        return
    finally:
        if kind == "adapter" and isinstance(lora, LoRARequest):
            shutil.rmtree(lora.lora_path, ignore_errors=True)
    env.outcomes["served"] += 1
    if accepted is not None:
        extra.add(accepted)


def _sampling(name: str, value, how: str) -> SamplingParams:
    base = {"temperature": 0, "max_tokens": 8}
    if how == "construct":
        return SamplingParams(**{**base, name: value})
    params = SamplingParams(**base)
    setattr(params, name, value)
    return params


def _submit(env: Env, entry: str, prompt, params, lora, rid, tenant) -> str | None:
    """Submit through `entry`; returns the id of a request left in flight (add_request), else None."""
    params = SamplingParams(temperature=0, max_tokens=8) if params is None else params
    engine = env.llm.llm_engine
    if entry == "LLM.generate" and rid is None:
        env.llm.generate(prompt, params, lora_request=lora, tenant=tenant)
        return None
    if entry == "AsyncEngine.generate":

        async def run():
            async for _ in engine.engine.generate(prompt, params, rid, lora, tenant=tenant):
                pass

        engine.call(run)
        return None
    rid = rid if rid is not None else f"odd-{uuid.uuid4().hex}"
    engine.add_request(rid, prompt, params, lora, tenant=tenant)
    return rid


def _call_shape(env: Env, shape: str, good: dict[str, int]) -> None:
    llm, engine = env.llm, env.llm.llm_engine
    p = {"prompt_token_ids": GOOD_PROMPTS[0]}
    sp = SamplingParams(temperature=0, max_tokens=3)
    calls = {
        "params_list_short": lambda: llm.generate([p, p], [sp]),
        "params_list_wrong_type": lambda: llm.generate([p], [{"max_tokens": 2}]),
        "lora_list_short": lambda: llm.generate([p, p], sp, lora_request=[None]),
        "prompts_int": lambda: llm.generate(7, sp),
        "prompts_bytes": lambda: llm.generate(b"abc", sp),
        "prompts_set": lambda: llm.generate({"a", "b"}, sp),
        "duplicate_in_flight": lambda: engine.add_request(next(iter(good)), p, sp),
        "duplicate_finished": lambda: engine.add_request(
            env.finished_ids[0] if env.finished_ids else next(iter(good)), p, sp
        ),
        "abort_int": lambda: engine.abort_request(5),
        "abort_mixed": lambda: engine.abort_request(["x", 5]),
        "add_lora_str": lambda: llm.add_lora("qv_r4"),
        "remove_lora_str": lambda: llm.remove_lora("1"),
        "pin_lora_float": lambda: llm.pin_lora(1.0),
        "arrival_nan": lambda: engine.add_request(f"odd-{uuid.uuid4().hex}", p, sp, arrival_time=math.nan),
        "arrival_str": lambda: engine.add_request(f"odd-{uuid.uuid4().hex}", p, sp, arrival_time="now"),
        "generate_empty_list": lambda: llm.generate([], sp),
    }
    try:
        calls[shape]()
    except E.LoraLedgerError as exc:
        env.outcomes[f"refused: {type(exc).__name__}"] += 1
        return
    # vLLM: an id may be reused once its request has finished (a finished one exists after the first example)
    assert shape == "generate_empty_list" or (shape == "duplicate_finished" and env.finished_ids), (
        f"{shape} was accepted"
    )
    env.outcomes["served"] += 1


# ---- damaged adapter folders --------------------------------------------------------------------


def _header_and_data(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _damaged_adapter(env: Env, damage: str, number: int, noise: bytes) -> LoRARequest:
    int_id = next(env.ids)
    folder = env.root / f"adapter-{int_id}"
    lora = LoRARequest(f"bad-{int_id}", int_id, str(folder))
    if damage == "missing_dir":
        return lora
    if damage == "not_a_dir":
        folder.write_bytes(noise)
        return lora
    shutil.copytree(env.adapter_source, folder)
    config, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    header, data = _header_and_data(weights)
    names = sorted(k for k in header if k != "__metadata__")
    name = names[number % len(names)]
    if damage == "no_config":
        config.unlink()
    elif damage == "config_not_json":
        config.write_bytes(b"{" + noise)
    elif damage == "config_array":
        config.write_text("[1, 2]")
    elif damage == "config_huge":
        config.write_text(json.dumps({**json.loads(config.read_text()), "pad": "x" * (2 << 20)}))
    elif damage == "config_rank":
        config.write_text(json.dumps({**json.loads(config.read_text()), "r": [0, -1, "8", 10**30, 3.5][number % 5]}))
    elif damage == "no_weights":
        weights.unlink()
    elif damage == "weights_is_dir":
        weights.unlink()
        weights.mkdir()
    elif damage == "empty_weights":
        weights.write_bytes(b"")
    elif damage == "truncated":
        raw = weights.read_bytes()
        weights.write_bytes(raw[: number % len(raw)])
    elif damage == "garbage":
        weights.write_bytes(noise * 64)
    elif damage == "header_len_huge":
        raw = weights.read_bytes()
        weights.write_bytes(struct.pack("<Q", 2**40 + number) + raw[8:])
    elif damage == "header_not_json":
        _write_raw = struct.pack("<Q", len(noise)) + noise + data
        weights.write_bytes(_write_raw)
    elif damage == "header_entry_bad":
        header[name] = [{"dtype": 5}, {"shape": "x"}, {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, -1]}, "x"][
            number % 4
        ]
        _write(weights, header, data)
    elif damage == "wrong_shape":
        rows, cols = header[name]["shape"]
        header[name]["shape"] = [cols, rows] if rows != cols else [rows * 2, cols // 2]
        _write(weights, header, data)
    elif damage == "rank_too_big":
        # a header that declares a rank-4096 lora_A the size of the real file would need: refused on the header alone
        begin, _ = header[name]["data_offsets"]
        header[name] = {"dtype": "F32", "shape": [4096, 64], "data_offsets": [begin, begin + 4096 * 64 * 4]}
        _write(weights, header, data)
    elif damage == "dtype_int8":
        begin, end = header[name]["data_offsets"]
        header[name]["dtype"] = "I8"
        header[name]["shape"] = [end - begin]
        _write(weights, header, data)
    elif damage == "trailing_bytes":
        with open(weights, "ab") as f:
            f.write(noise)
    elif damage == "sparse_64g":
        os.truncate(weights, 64 << 30)
    elif damage == "nan_weight":
        begin, _ = header[name]["data_offsets"]
        data = data[:begin] + struct.pack("<f", math.nan) + data[begin + 4 :]
        _write(weights, header, data)
    elif damage == "overlapping":
        other = names[(number + 1) % len(names)]
        header[name]["data_offsets"] = list(header[other]["data_offsets"])
        _write(weights, header, data)
    elif damage == "bin_only":
        weights.unlink()
        (folder / "adapter_model.bin").write_bytes(noise)
    return lora
