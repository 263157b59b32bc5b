"""Prompt tokens' logprobs in the completions API: `echo` with `logprobs` (lm-eval's loglikelihood requests, often
with `max_tokens: 0`) and the `prompt_logprobs` field, both in vLLM's shapes."""

from __future__ import annotations

from loraledger.outputs import Logprob
from loraledger.server.serving_engine import LOGPROB_FLOOR


def echo_only(req) -> bool:
    """True for `echo` with `max_tokens: 0`: the answer is the prompt alone (vLLM runs one token and drops it)."""
    return bool(req.echo) and req.max_tokens == 0


def prompt_logprobs_wanted(req) -> int | None:
    """The number of top alternatives per prompt token the engine must compute, or None for none."""
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    return max(wanted) if wanted else None


def _text(entry: Logprob | None, token_id: int, tokenizer) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    if tokenizer is not None:
        return tokenizer.decode([token_id])
    return f"token_id:{token_id}"


def _floor(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def echo_logprobs(prompt_ids, prompt_logprobs, k: int, tokenizer) -> dict:
    """The completions API's logprobs object for the prompt tokens, as vLLM sends it with echo: the first token's
    logprob and top alternatives are null (nothing precedes it), each other token has its top `k` alternatives."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for token_id, entries in zip(prompt_ids, prompt_logprobs or [None] * len(prompt_ids)):
        chosen = entries.get(token_id) if entries else None
        text = _text(chosen, token_id, tokenizer)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entries is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_floor(chosen.logprob) if chosen is not None else None)
        ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
        alternatives = {_text(lp, tid, tokenizer): _floor(lp.logprob) for tid, lp in ranked[: max(k, 1)]}
        if chosen is not None:
            alternatives[text] = _floor(chosen.logprob)  # the prompt's own token is always listed, as vLLM does
        top.append(alternatives)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


def joined(prompt: dict, generated: dict | None) -> dict:
    """The echoed prompt's logprobs followed by the generated tokens' (whose offsets already count the echo)."""
    if generated is None:
        return prompt
    return {key: prompt[key] + generated[key] for key in prompt}


def prompt_logprobs_body(prompt_logprobs) -> list | None:
    """A response's `prompt_logprobs` as vLLM serializes it: per prompt position null or
    {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entries is None
        else {
            str(tid): {"logprob": _floor(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entries.items()
        }
        for entries in prompt_logprobs
    ]
