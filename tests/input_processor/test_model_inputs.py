"""check_model_inputs, admission's model checks: prompt ids, vocabulary, length, bad words and constraint, or a typed error."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from loraledger import LoRARequest, SamplingParams
from loraledger import errors as E
from loraledger.actors.messages import Submit
from loraledger.input_processor import check_model_inputs
from loraledger.structured_outputs import StructuredOutputsParams, canonical_constraint

VOCAB = 128  # the code points below it are the tokens
MAX_LEN = 16
DROPPED = "\u200b"  # a character the tokenizer drops (as real ones drop some whitespace)


class CharTokenizer:
    """One token per character (its code point), as a Hugging Face tokenizer encodes; truncation on either side."""

    truncation_side = "right"

    def _ids(self, text: str) -> list[int]:
        return [ord(c) for c in text if c != DROPPED]

    def encode(
        self, text: str, add_special_tokens: bool = True, truncation: bool = False, max_length: int | None = None
    ) -> list[int]:
        ids = self._ids(text)
        if truncation and max_length is not None and len(ids) > max_length:
            ids = ids[-max_length:] if self.truncation_side == "left" else ids[:max_length]
        return ids


TOKENIZER = CharTokenizer()


def two_kinds(bad_words: list[str] | None = None) -> SamplingParams:
    """Params whose constraint sets two kinds (refused where it is built, so it is changed afterwards)."""
    so = StructuredOutputsParams(regex="a")
    so.grammar = "root ::= x"
    params = SamplingParams(bad_words=bad_words)
    params.structured_outputs = so
    return params


def msg(prompt=None, ids=None, params=None, lora=None) -> Submit:
    return Submit(
        request_id="audit-key",
        prompt=prompt,
        prompt_token_ids=ids,
        params=SamplingParams() if params is None else params,
        lora_request=lora,
        tenant=None,
        arrival_time=0.0,
        channel=None,
        caller_request_id="r1",
    )


def check(m: Submit, tokenizer=TOKENIZER, *, enable_lora: bool = True):
    return check_model_inputs(m, tokenizer, vocab_size=VOCAB, max_model_len=MAX_LEN, enable_lora=enable_lora)


def test_a_text_prompt_becomes_its_token_ids():
    out = check(msg("hello"))
    assert (
        out.prompt_token_ids == [ord(c) for c in "hello"] and out.bad_words_token_ids == [] and out.constraint is None
    )


def test_token_ids_are_kept_as_given_or_cut_on_the_left():
    assert check(msg(ids=[1, 2, 3])).prompt_token_ids == [1, 2, 3]
    assert check(msg(ids=[1, 2, 3], params=SamplingParams(truncate_prompt_tokens=2))).prompt_token_ids == [2, 3]
    long = list(range(1, 40))
    assert check(msg(ids=long, params=SamplingParams(truncate_prompt_tokens=5))).prompt_token_ids == long[-5:]
    with pytest.raises(E.PromptTooLongError):  # -1 keeps max_model_len tokens: no room is left to generate
        check(msg(ids=long, params=SamplingParams(truncate_prompt_tokens=-1)))
    text = check(msg("abcdef", params=SamplingParams(truncate_prompt_tokens=2))).prompt_token_ids
    assert text == [ord("e"), ord("f")]
    assert TOKENIZER.truncation_side == "right"  # the left-truncating one is a copy


def test_bad_words_are_tokenized_without_special_tokens():
    out = check(msg("hi", params=SamplingParams(bad_words=["no", " ok"])))
    assert out.bad_words_token_ids == [[ord("n"), ord("o")], [ord("o"), ord("k")]]


def test_a_constraint_is_in_its_canonical_form():
    so = StructuredOutputsParams(choice=["yes", "no"])
    out = check(msg("hi", params=SamplingParams(structured_outputs=so)))
    assert out.constraint == canonical_constraint(so) and out.constraint.kind == "choice"


BAD = [
    ("empty token ids", msg(ids=[]), E.PromptError),
    ("token id outside the vocabulary", msg(ids=[1, VOCAB]), E.PromptError),
    ("too many token ids", msg(ids=[1] * MAX_LEN), E.PromptTooLongError),
    ("too long a text", msg("x" * MAX_LEN), E.PromptTooLongError),
    ("empty text", msg(""), E.PromptError),
    ("text of another type", msg(prompt=None), E.PromptError),
    ("text that tokenizes to nothing", msg(DROPPED * 3), E.PromptError),
    ("a character outside the vocabulary", msg("h\u00e9"), E.PromptError),
    (
        "a bad word outside the vocabulary",
        msg("hi", params=SamplingParams(bad_words=["\u00e9"])),
        E.SamplingParamsError,
    ),
    ("two kinds of constraint", msg("hi", params=two_kinds()), E.StructuredOutputError),
]


@pytest.mark.parametrize("m, error", [(m, e) for _, m, e in BAD], ids=[name for name, _, _ in BAD])
def test_each_bad_input_has_its_typed_error(m, error):
    with pytest.raises(error) as info:
        check(m)
    assert type(info.value) is error
    assert "'r1'" in str(info.value) or error is E.StructuredOutputError  # it names the caller's id


def test_what_needs_a_tokenizer_or_lora_is_refused_without_it():
    with pytest.raises(E.NoTokenizerError):
        check(msg("hi"), tokenizer=None)
    with pytest.raises(E.NoTokenizerError):
        check(msg(ids=[1], params=SamplingParams(bad_words=["x"])), tokenizer=None)
    so = StructuredOutputsParams(json_object=True)
    with pytest.raises(E.NoTokenizerError):
        check(msg(ids=[1], params=SamplingParams(structured_outputs=so)), tokenizer=None)
    assert check(msg(ids=[1]), tokenizer=None).prompt_token_ids == [1]
    with pytest.raises(E.LoRADisabledError):
        check(msg(ids=[1], lora=LoRARequest("sql", 1, "/adapters/sql")), enable_lora=False)


def test_the_prompt_is_checked_before_the_bad_words_and_the_bad_words_before_the_constraint():
    with pytest.raises(E.PromptTooLongError):
        check(msg(ids=[1] * MAX_LEN, params=two_kinds(["\u00e9"])))
    with pytest.raises(E.SamplingParamsError) as info:
        check(msg(ids=[1], params=two_kinds(["\u00e9"])))
    assert not isinstance(info.value, E.StructuredOutputError)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.one_of(
        st.text(alphabet=st.characters(max_codepoint=VOCAB + 8) | st.just(DROPPED), max_size=3 * MAX_LEN),
        st.lists(st.integers(0, VOCAB + 8), max_size=3 * MAX_LEN),
    ),
    truncate=st.sampled_from([None, -1, 1, 5, MAX_LEN]),
    bad_words=st.lists(
        st.text(alphabet=st.characters(max_codepoint=VOCAB + 8), min_size=1, max_size=3).filter(str.strip), max_size=2
    ),
)
def test_any_prompt_gives_ids_the_model_can_run_or_a_typed_error(prompt, truncate, bad_words):
    params = SamplingParams(truncate_prompt_tokens=truncate, bad_words=bad_words)
    m = msg(prompt, None, params) if isinstance(prompt, str) else msg(None, prompt, params)
    ids = TOKENIZER._ids(prompt) if isinstance(prompt, str) else prompt
    kept = ids[-(MAX_LEN if truncate == -1 else truncate) :] if truncate is not None else ids
    try:
        out = check(m)
    except E.PromptTooLongError:
        event("refused: too long")
        assert len(kept) >= MAX_LEN
    except E.PromptError:
        event("refused: prompt")
        assert not kept or any(t >= VOCAB for t in kept)
    except E.SamplingParamsError:
        event("refused: bad words")
        assert any(ord(c) >= VOCAB for w in bad_words for c in w)
    else:
        event("accepted")
        assert out.prompt_token_ids == kept and 0 < len(kept) < MAX_LEN and all(0 <= t < VOCAB for t in kept)
        assert all(0 <= t < VOCAB for ids in out.bad_words_token_ids for t in ids)
        assert out == check(m)  # pure: the same request, the same inputs
