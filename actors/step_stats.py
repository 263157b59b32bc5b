"""StepStats: the Scheduler actor's own per-step timing (where a step's time goes: forward pass vs engine overhead), and
the queue state a server's /metrics shows (requests running and waiting, their adapters, KV use, slot churn)."""

from __future__ import annotations

import msgspec

from loraledger.scheduling.step_plan import StepOutput, StepPlan


class StatsSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    steps: int
    tokens: int
    sequences: int  # sequence-steps, summed
    wall_seconds: float  # per step: from the previous step's results (or this plan, after idling) to this one's, summed
    forward_seconds: float  # launching the forward and sampling, and waiting for the results, in the step thread
    prepare_seconds: float  # input tensors from the plan, in the worker thread
    schedule_seconds: float
    update_seconds: float
    free_kv_blocks: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    gpu_seconds: float = 0.0  # CUDA: device time of the steps' work (events around each step)
    gpu_idle_seconds: float = 0.0  # CUDA: device time spent waiting between one step's work and the next
    # the queues now (vLLM's gauges): requests with a sequence in the running batch, and the others the Scheduler holds
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    running_lora_adapters: list[str] = []  # adapter names of the running requests, sorted
    waiting_lora_adapters: list[str] = []  # ... of the waiting ones
    max_loras: int = 0  # adapter slots on the device
    num_kv_blocks: int = 0
    kv_cache_usage: float = 0.0  # share of KV blocks held by sequences (cached free blocks count as free), 0..1
    slot_loads: dict[str, int] = {}  # adapter name -> times its weights were loaded into a device slot
    slot_evictions: dict[str, int] = {}  # adapter name -> times another adapter took its slot

    @property
    def overhead_fraction(self) -> float:
        """Share of step wall time spent outside the forward pass (scheduling, messages, input prep, updates)."""
        if self.wall_seconds <= 0:
            return 0.0
        return 1.0 - self.forward_seconds / self.wall_seconds


class StepStats:
    """Accumulates per-step timings; owned by the Scheduler (read through a GetStats message)."""

    def __init__(self) -> None:
        self.steps = self.tokens = self.sequences = 0
        self.wall = self.forward = self.prepare = self.schedule = self.update = 0.0
        self.gpu = self.gpu_idle = 0.0

    def add(self, plan: StepPlan, output: StepOutput | None, schedule_s: float, update_s: float, wall_s: float) -> None:
        self.steps += 1
        self.sequences += len(plan.seqs)
        self.tokens += sum(len(w.token_ids) for w in plan.seqs)
        self.wall += wall_s
        self.schedule += schedule_s
        self.update += update_s
        if output is not None:
            self.forward += output.forward_seconds
            self.prepare += output.prepare_seconds
            self.gpu += output.gpu_seconds or 0.0
            self.gpu_idle += output.gpu_idle_seconds or 0.0

    def snapshot(self, blocks, queues: dict | None = None) -> StatsSnapshot:
        """queues: the policy's queue state and slot counters (num_requests_running, ..., slot_evictions; see StatsSnapshot)."""
        hits, queries = _prefix_counters(blocks)
        total = int(getattr(blocks, "num_blocks", 0))
        return StatsSnapshot(
            steps=self.steps,
            tokens=self.tokens,
            sequences=self.sequences,
            wall_seconds=self.wall,
            forward_seconds=self.forward,
            prepare_seconds=self.prepare,
            schedule_seconds=self.schedule,
            update_seconds=self.update,
            free_kv_blocks=blocks.num_free_blocks,
            prefix_cache_hit_tokens=hits,
            prefix_cache_query_tokens=queries,
            gpu_seconds=self.gpu,
            gpu_idle_seconds=self.gpu_idle,
            num_kv_blocks=total,
            kv_cache_usage=(1.0 - blocks.num_free_blocks / total) if total else 0.0,
            **(queues or {}),
        )


def _prefix_counters(blocks) -> tuple[int, int]:
    stats = getattr(blocks, "stats", None)
    if stats is None:
        return 0, 0
    if isinstance(stats, dict):
        return int(stats.get("hit_tokens", 0)), int(stats.get("query_tokens", 0))
    return int(getattr(stats, "hit_tokens", 0)), int(getattr(stats, "query_tokens", 0))
