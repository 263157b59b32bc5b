"""Stop rules: stop ids and EOS after min_tokens, max_tokens and max_model_len as "length", a completed grammar."""

from __future__ import annotations

from loraledger.sampling_params import SamplingParams
from loraledger.scheduling.request_state import SchedRequest, Seq
from loraledger.scheduling.step_plan import SamplingSpec
from loraledger.scheduling.stop_rules import check_stop, ends_in_flight

PROMPT = [5, 6, 7]


def _seq(outputs: list[int], *, max_output: int = 8, min_tokens: int = 0, pending: int = 0) -> Seq:
    req = SchedRequest(
        audit_id="r",
        order=0,
        params=SamplingParams(min_tokens=min_tokens, max_tokens=max_output),
        lora_request=None,
        checkpoint=None,
        adapter_fingerprint="",
        prompt_len=len(PROMPT),
        max_output=max_output,
        stop_ids=frozenset({42}),
        eos_ids=frozenset({2}),
    )
    seq = Seq(seq_id=0, index=0, request=req, token_ids=PROMPT + outputs, spec=SamplingSpec(), pending=pending)
    req.seqs.append(seq)
    return seq


def test_a_stop_id_ends_with_itself_as_stop_reason_and_eos_with_none():
    assert check_stop(_seq([9, 42]), 42, 128) == ("stop", 42)
    assert check_stop(_seq([9, 2]), 2, 128) == ("stop", None)
    assert check_stop(_seq([9, 9]), 9, 128) == (None, None)


def test_min_tokens_holds_stop_ids_and_eos_back():
    assert check_stop(_seq([2], min_tokens=3), 2, 128) == (None, None)
    assert check_stop(_seq([42], min_tokens=3), 42, 128) == (None, None)
    assert check_stop(_seq([9, 9, 42], min_tokens=3), 42, 128) == ("stop", 42)


def test_max_tokens_and_max_model_len_end_with_length():
    assert check_stop(_seq([9] * 8, max_output=8), 9, 128) == ("length", None)
    assert check_stop(_seq([9] * 7, max_output=8), 9, 128) == (None, None)
    assert check_stop(_seq([9, 9]), 9, len(PROMPT) + 2) == ("length", None)


def test_a_completed_grammar_stops_whatever_min_tokens_says():
    assert check_stop(_seq([9], min_tokens=5), 9, 128, grammar_done=True) == ("stop", None)
    assert check_stop(_seq([42], min_tokens=5), 42, 128, grammar_done=True) == ("stop", 42)


def test_a_sequence_the_steps_in_flight_end_by_length_gets_no_more_work():
    assert not ends_in_flight(_seq([9] * 6, max_output=8), 128)  # nothing in flight
    assert not ends_in_flight(_seq([9] * 6, max_output=8, pending=1), 128)
    assert ends_in_flight(_seq([9] * 7, max_output=8, pending=1), 128)
    assert ends_in_flight(_seq([9] * 2, pending=1), len(PROMPT) + 3)
