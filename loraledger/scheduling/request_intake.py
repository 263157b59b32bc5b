"""RequestIntake: a NewRequest turned into the policy's SchedRequest and its n sequences, each with its SamplingSpec."""

from __future__ import annotations

import random

from loraledger.actors.messages import NewRequest
from loraledger.errors import RequestFailedError
from loraledger.scheduling.request_state import SchedRequest, Seq
from loraledger.scheduling.scheduler_config import SchedulerConfig
from loraledger.scheduling.step_plan import SamplingSpec


class RequestIntake:
    """Numbers requests (admission order) and sequences, and draws the seeds of unseeded requests."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._eos = frozenset(config.eos_token_ids)
        self._extra_stop = frozenset(config.extra_stop_ids) - self._eos
        self._rng = random.Random(config.seed)
        self._next_order = 0
        self._next_seq_id = 0

    def make(self, msg: NewRequest) -> SchedRequest:
        """The request of a NewRequest with all its sequences; the numbering moves on only once all of them exist."""
        params = msg.params
        ckpt = msg.checkpoint
        prompt_len = len(msg.prompt_token_ids)
        room = self._config.max_model_len - prompt_len
        max_output = min(params.max_tokens, room) if params.max_tokens is not None else room
        eos = frozenset() if params.ignore_eos else self._eos
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self._extra_stop)
        req = SchedRequest(
            audit_id=msg.audit_id,
            order=self._next_order,
            params=params,
            lora_request=msg.lora_request,
            checkpoint=ckpt,
            adapter_fingerprint=ckpt.fingerprint if ckpt is not None else "",
            prompt_len=prompt_len,
            max_output=max(1, max_output),
            stop_ids=stop_ids,
            eos_ids=eos,
            grammar=msg.grammar,
            caller_request_id=msg.caller_request_id,
            cache_salt=msg.cache_salt,
        )
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        bias = params.logit_bias or {}
        for index in range(params.n):
            spec = SamplingSpec(
                temperature=float(params.temperature),
                top_p=float(params.top_p),
                top_k=int(params.top_k),
                min_p=float(params.min_p),
                # vLLM's parallel sampling: completion i of a seeded request draws as a request with seed + i would
                seed=mix_seed(base_seed + index, 0),
                presence_penalty=float(params.presence_penalty),
                frequency_penalty=float(params.frequency_penalty),
                repetition_penalty=float(params.repetition_penalty),
                logprobs=self._num_logprobs(params.logprobs),
                prompt_logprobs=-1 if index > 0 else self._num_logprobs(params.prompt_logprobs),
                min_tokens=int(params.min_tokens),
                stop_ids=sorted(eos | stop_ids),
                bias_token_ids=list(bias),
                bias_values=list(bias.values()),
                allowed_token_ids=list(params.allowed_token_ids or ()),
                bad_words=[list(w) for w in msg.bad_words_token_ids],
            )
            req.seqs.append(
                Seq(
                    seq_id=self._next_seq_id + index,
                    index=index,
                    request=req,
                    token_ids=list(msg.prompt_token_ids),
                    spec=spec,
                )
            )
        self._next_order += 1
        self._next_seq_id += len(req.seqs)
        return req

    def _num_logprobs(self, asked: int | None) -> int:
        """SamplingSpec's count: -1 for none; SamplingParams' -1 (the whole vocabulary) as the vocabulary's size."""
        if asked is None:
            return -1
        if asked == -1:
            if self._config.vocab_size is None:
                raise RequestFailedError(
                    "logprobs=-1 asks for the whole vocabulary, whose size this scheduler was not given"
                )
            return self._config.vocab_size
        return int(asked)


def mix_seed(seed: int, index: int) -> int:
    """A distinct, reproducible 62-bit seed per (seed, index) (splitmix64 finaliser); seeds outside 64 bits wrap."""
    z = ((seed & 0xFFFFFFFFFFFFFFFF) * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2
