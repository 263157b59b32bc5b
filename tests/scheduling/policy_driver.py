"""Drives a SchedulingPolicy the way the scheduler actor does, one step at a time, with a stand-in executor."""

from __future__ import annotations

from dataclasses import dataclass

from loraledger.actors.messages import NewRequest
from loraledger.sampling_params import SamplingParams
from loraledger.scheduling.policy import ScheduledStep, SchedulingPolicy
from loraledger.scheduling.scheduler_config import SchedulerConfig
from loraledger.scheduling.step_plan import SampledToken, StepOutput
from loraledger.scheduling.step_update import StepResult

DEFAULTS = dict(
    num_kv_blocks=1024,
    block_size=4,
    enable_prefix_caching=False,
    max_num_seqs=16,
    max_num_batched_tokens=128,
    max_model_len=128,
    max_loras=1,
    eos_token_ids=(),
    seed=0,
)


@dataclass(frozen=True)
class Adapter:
    """What the policy reads of a checkpoint: its fingerprint (the slot key and prefix-cache salt) and name."""

    fingerprint: str
    name: str = ""


def make_policy(**overrides) -> SchedulingPolicy:
    return SchedulingPolicy(SchedulerConfig(**{**DEFAULTS, **overrides}))


def new_request(
    audit_id: str, prompt: list[int], params: SamplingParams, adapter: Adapter | None = None, **fields
) -> NewRequest:
    return NewRequest(
        audit_id=audit_id,
        prompt_token_ids=prompt,
        params=params.frozen(),
        lora_request=None,
        checkpoint=adapter,
        arrival_time=0.0,
        queued_time=0.0,
        **fields,
    )


def sample_all(step: ScheduledStep, token: int = 9) -> StepOutput:
    """What a stand-in executor returns: `token` for every sequence that asks for one."""
    plan = step.plan
    return StepOutput(
        step_id=plan.step_id,
        sampled=[SampledToken(seq_id=w.seq_id, token_id=token, logprob=0.0) for w in plan.seqs if w.sample],
    )


def run_step(policy: SchedulingPolicy, token: int = 9) -> tuple[ScheduledStep, StepResult] | None:
    """Schedule one step, "execute" it and update the policy with its output; None when there is nothing to run."""
    step = policy.schedule()
    if step is None:
        return None
    return step, policy.update(step, sample_all(step, token))
