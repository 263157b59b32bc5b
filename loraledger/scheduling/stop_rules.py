"""When a sequence ends: stop ids, EOS, min_tokens, max_tokens, max_model_len and a completed grammar."""

from __future__ import annotations

from loraledger.scheduling.request_state import Seq


def check_stop(seq: Seq, token: int, max_model_len: int, grammar_done: bool = False) -> tuple[str | None, int | None]:
    """(finish_reason, stop_reason) once `token` is appended to the sequence; (None, None) while it goes on."""
    req = seq.request
    n_out = seq.num_output
    if grammar_done:  # the grammar is complete (it took EOS): nothing may follow, whatever min_tokens or ignore_eos say
        return "stop", token if token in req.stop_ids else None
    if n_out >= req.params.min_tokens:
        if token in req.stop_ids:
            return "stop", token
        if token in req.eos_ids:
            return "stop", None
    if n_out >= req.max_output or len(seq.token_ids) >= max_model_len:
        return "length", None
    return None, None


def ends_in_flight(seq: Seq, max_model_len: int) -> bool:
    """The steps in flight will end this sequence by length whatever they sample: plan nothing more for it."""
    if not seq.pending:
        return False
    return seq.num_output + seq.pending >= seq.request.max_output or len(seq.token_ids) + seq.pending >= max_model_len
