"""Structured outputs: each kind's outputs parse and validate, in mixed batches with adapters, in every sampling mode,
against a transformers + PEFT reference masked by the same grammar engine, and vLLM's rules by name.

The fixture model is random: its unconstrained text is noise, so any structure in an output is the constraint's.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from loraledger import LLM, SamplingParams
from loraledger import errors as E
from loraledger.sampling_params import StructuredOutputsParams
from tests.api.conftest import loras_for, random_prompts
from tests.model_fixtures import hf_reference_generate

SCHEMA = {
    "type": "object",
    "properties": {
        "sql": {
            "type": "string",
            "pattern": "^[a-z ]{1,6}$",
        },  # (xgrammar: maxLength alone lets raw control characters in)
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["sql", "n", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe later"]
GRAMMAR = 'root ::= "(" digits ")"\ndigits ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]'
MAX = 48


def _so(kind: str) -> StructuredOutputsParams:
    return {
        "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
        "grammar": StructuredOutputsParams(grammar=GRAMMAR),
        "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    }[kind]


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([0-9]{1,3}\)", text) is not None


def _gen(llm, prompts, params, loras=None):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)


def _texts(n: int, seed: int) -> list[str]:
    """Text prompts (a token-id prompt of random bytes can end inside a UTF-8 character, which the output's text would
    then complete: the constraint holds for the tokens, not for such a joined text)."""
    words = "the quick brown fox jumps over a lazy dog while seven river legs warm short blocks".split()
    rng = __import__("random").Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(n)]


def _gen_text(llm, prompts, params, loras=None):
    return llm.generate(prompts, params, lora_request=loras, use_tqdm=False)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(
        model=str(tiny_llama.model_dir),
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        block_size=4,
        audit_url=None,
        seed=0,
    )
    yield llm
    llm.close()


def test_each_kind_parses_in_one_mixed_batch_with_adapters(llm, tiny_llama):
    """Every kind, unconstrained rows, the base model and two adapters share the steps; each output validates and ends
    with finish_reason="stop" when its grammar completes; the unconstrained rows are the model's noise, unchanged."""
    loras = loras_for(tiny_llama)
    kinds = ["json", "regex", "choice", "grammar", "json_object", None]
    adapters = [None, "all_r8", "qv_r4"]
    prompts = _texts(12, seed=200)
    params, lora_list, plan = [], [], []
    for i, prompt in enumerate(prompts):
        kind, adapter = kinds[i % len(kinds)], adapters[i % len(adapters)]
        params.append(SamplingParams(temperature=0, max_tokens=MAX, structured_outputs=_so(kind) if kind else None))
        lora_list.append(loras[adapter] if adapter else None)
        plan.append(kind)
    outs = _gen_text(llm, prompts, params, lora_list)
    for kind, out in zip(plan, outs):
        c = out.outputs[0]
        if kind is None:
            continue
        assert c.finish_reason == "stop", (kind, c.text)
        assert _valid(kind, c.text), (kind, c.text)
    alone = _gen_text(
        llm,
        [p for p, k in zip(prompts, plan) if k is None],
        [SamplingParams(temperature=0, max_tokens=MAX)] * 2,
        [lo for lo, k in zip(lora_list, plan) if k is None],
    )
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o, k in zip(outs, plan) if k is None]


class _GrammarProcessor(LogitsProcessor):
    """The reference: transformers' logits masked by an xgrammar matcher fed with the tokens generate() chose."""

    def __init__(self, compiled, prompt_len: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.prompt_len = prompt_len
        self.bitmask = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        if self.bitmask is None:
            self.bitmask = xgr.allocate_token_bitmask(1, scores.shape[-1])
        self.matcher.fill_next_token_bitmask(self.bitmask)
        scores = scores.float().clone()
        xgr.apply_token_bitmask_inplace(scores, self.bitmask, vocab_size=scores.shape[-1])
        return scores


@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_greedy_equals_transformers_masked_by_the_same_grammar(llm, tiny_llama, kind):
    """Greedy constrained output = transformers + PEFT greedy with its logits masked by xgrammar, token for token
    (EOS included: the grammar ends the output with it)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.model_dir)
    vocab = tiny_llama.config.vocab_size
    eos = tokenizer.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    compiled = {
        "json": lambda: compiler.compile_json_schema(SCHEMA, any_whitespace=False),
        "regex": lambda: compiler.compile_regex(REGEX),
        "grammar": lambda: compiler.compile_grammar(GRAMMAR),
    }[kind]()
    loras = loras_for(tiny_llama)
    prompts = random_prompts(2, seed=210)
    names = [None, "all_r8"]
    outs = _gen(
        llm,
        prompts,
        SamplingParams(temperature=0, max_tokens=MAX, structured_outputs=_so(kind)),
        [None, loras["all_r8"]],
    )
    for prompt, name, out in zip(prompts, names, outs):
        proc = _GrammarProcessor(compiled, len(prompt))
        ref = hf_reference_generate(
            tiny_llama.model_dir,
            tiny_llama.adapters,
            [prompt],
            [name],
            MAX,
            mixed=False,
            logits_processor=LogitsProcessorList([proc]),
            eos_token_id=eos,
        ).token_ids[0]
        assert out.outputs[0].token_ids == ref
        assert ref[-1] == eos and out.outputs[0].finish_reason == "stop"


def test_sampled_n_and_logprobs_report_the_constrained_distribution(llm, tiny_llama):
    """Sampled rows and n > 1: every completion has its own matcher and validates. Logprobs are those of the masked
    logits: at each step the tokens the grammar allows carry the whole probability (their top-20 logprobs sum to 1),
    and every token with a finite logprob continues the output towards one of the choices."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.model_dir)
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=MAX, logprobs=20, structured_outputs=_so("choice"))
    outs = _gen_text(llm, _texts(2, seed=220), params)
    for out in outs:
        assert len(out.outputs) == 3
        for c in out.outputs:
            assert c.text in CHOICES and c.finish_reason == "stop"
            prefix: list[int] = []
            for token, step in zip(c.token_ids, c.logprobs):
                finite = {t: lp.logprob for t, lp in step.items() if lp.logprob != float("-inf")}
                assert token in finite
                if token == tokenizer.eos_token_id:
                    assert list(finite) == [token] and finite[token] == pytest.approx(
                        0.0, abs=1e-5
                    )  # complete: EOS alone
                    break
                assert sum(torch.tensor(list(finite.values())).exp().tolist()) == pytest.approx(1.0, abs=1e-3)
                for t in finite:
                    if t != tokenizer.eos_token_id:
                        text = tokenizer.decode(prefix + [t])
                        assert any(choice.startswith(text) for choice in CHOICES), (text, CHOICES)
                prefix.append(token)


def test_stop_strings_and_constraints_together(llm):
    """A stop string inside the constrained output ends it there (finish_reason "stop", the stop string as stop_reason)."""
    out = _gen_text(
        llm,
        _texts(1, seed=230),
        SamplingParams(
            temperature=0,
            max_tokens=MAX,
            stop=["later"],
            structured_outputs=StructuredOutputsParams(choice=["maybe later"]),
        ),
    )[0]
    c = out.outputs[0]
    assert c.text == "maybe " and c.finish_reason == "stop" and c.stop_reason == "later"


def test_the_grammar_ends_the_output_whatever_ignore_eos_and_min_tokens_say(llm):
    """Once the grammar is complete only EOS may follow: the request stops there (finish_reason "stop"), also with
    ignore_eos=True and with min_tokens beyond the grammar's length (which would otherwise hold EOS back)."""
    for extra in ({"ignore_eos": True}, {"min_tokens": 20}):
        out = _gen_text(
            llm,
            _texts(1, seed=235),
            SamplingParams(temperature=0, max_tokens=MAX, structured_outputs=_so("choice"), **extra),
        )[0]
        c = out.outputs[0]
        assert c.text in CHOICES and c.finish_reason == "stop" and len(c.token_ids) < 20, extra


def test_preemption_and_async_scheduling_keep_the_grammar(tiny_llama):
    """With few KV blocks (sequences preempted and recomputed) and with async scheduling (steps planned ahead; a
    constrained row's mask waits for the token before it), constrained outputs equal those of a roomy synchronous engine."""
    prompts = random_prompts(6, seed=240, lo=10, hi=16)
    params = [
        SamplingParams(temperature=t, seed=3, max_tokens=MAX, structured_outputs=_so(k))
        for t, k in zip([0, 1.0, 0, 1.0, 0, 1.0], ["json", "json", "regex", "grammar", "choice", "json_object"])
    ]
    outs, preemptions = {}, {}
    for name, kw in {"roomy": {}, "tight": {"num_kv_blocks": 20}, "async": {"async_scheduling": True}}.items():
        engine = LLM(model=str(tiny_llama.model_dir), block_size=4, audit_url=None, seed=0, **kw)
        try:
            done = _gen(engine, prompts, params)
        finally:
            engine.close()
        outs[name] = [o.outputs[0].token_ids for o in done]
        preemptions[name] = sum(o.metrics.num_preemptions for o in done)
    assert preemptions["tight"] > 0, "the cache was meant to be too small"
    assert outs["tight"] == outs["roomy"]
    assert outs["async"] == outs["roomy"]


def test_grammars_compile_once_per_distinct_constraint(llm):
    """The cache is keyed by the canonical form: the same schema as a dict in another key order, or as JSON text, is no new compile."""
    grammars = llm.llm_engine.engine._live().grammars
    reordered = dict(reversed(list(SCHEMA.items())))
    before = grammars.compiles
    for so in (
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json=reordered),
        StructuredOutputsParams(json=json.dumps(SCHEMA)),
    ):
        _gen(llm, random_prompts(1, seed=250), SamplingParams(temperature=0, max_tokens=2, structured_outputs=so))
    assert grammars.compiles == before + 1


# -- vLLM's rules ---------------------------------------------------------------------------------


def test_rule_exactly_one_kind():
    """vLLM: exactly one kind of constraint; none or two is a StructuredOutputError (a SamplingParamsError) naming them."""
    with pytest.raises(E.StructuredOutputError, match="exactly one kind.*json, regex are set"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(E.StructuredOutputError, match="none is set"):
        StructuredOutputsParams(disable_any_whitespace=True)
    with pytest.raises(E.SamplingParamsError, match="none is set"):
        StructuredOutputsParams(json_object=False)


def test_rule_kind_values_are_checked():
    """Each kind's value has its type: a schema object (or its JSON text), non-empty strings, a non-empty choice list."""
    for bad, match in [
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1, 2]}, "must be a JSON schema object"),
        ({"regex": ""}, "non-empty string"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", 3]}, "non-empty strings"),
        ({"json_object": "yes"}, "must be True"),
        ({"regex": "a", "whitespace_pattern": " *"}, "whitespace_pattern is not supported"),
    ]:
        with pytest.raises(E.StructuredOutputError, match=match):
            StructuredOutputsParams(**bad)
    with pytest.raises(E.SamplingParamsError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})


def test_rule_disable_additional_properties_closes_objects():
    """vLLM's disable_additional_properties: object schemas that do not say otherwise get additionalProperties false."""
    from loraledger.structured_outputs import canonical_constraint

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    c = canonical_constraint(StructuredOutputsParams(json=schema, disable_additional_properties=True))
    assert c.spec["additionalProperties"] is False and c.spec["properties"]["a"]["additionalProperties"] is False


def test_a_grammar_that_does_not_compile_fails_that_request_only(llm):
    """A compile error is a StructuredOutputError at admission, naming the problem; the engine serves the others."""
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(grammar="root ::= undefined_rule"))
    with pytest.raises(E.StructuredOutputError, match="grammar constraint .* does not compile"):
        _gen(llm, random_prompts(1, seed=260), bad)
    with pytest.raises(E.StructuredOutputError, match="regex constraint .* does not compile"):
        _gen(
            llm,
            random_prompts(1, seed=261),
            SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(a")),
        )
    ok = _gen_text(
        llm, _texts(1, seed=262), SamplingParams(temperature=0, max_tokens=MAX, structured_outputs=_so("regex"))
    )
    assert _valid("regex", ok[0].outputs[0].text)


def test_a_constraint_the_other_masks_leave_no_token_for_fails_that_request_only(llm):
    """allowed_token_ids (or bad_words) may leave none of the tokens the grammar allows: that request fails with
    StructuredOutputError, alone; the request beside it in the batch, and the engine, go on."""
    choice = StructuredOutputsParams(choice=CHOICES)
    good = SamplingParams(temperature=0, max_tokens=MAX, structured_outputs=choice)
    bad = SamplingParams(temperature=0, max_tokens=MAX, allowed_token_ids=[5], structured_outputs=choice)
    engine = llm.llm_engine
    engine.add_request("bad", "the quick brown fox", bad)
    engine.add_request("good", "a lazy dog", good)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert isinstance(engine.errors["bad"], E.StructuredOutputError), engine.errors["bad"]
    assert "'bad'" in str(engine.errors["bad"]) and "allowed_token_ids" in str(engine.errors["bad"])
    assert outs["good"].outputs[0].finish_reason == "stop" and outs["good"].outputs[0].text in CHOICES
    after = _gen_text(llm, _texts(1, seed=270), good)
    assert after[0].outputs[0].text in CHOICES
