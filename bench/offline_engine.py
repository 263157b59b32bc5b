"""loraledger's offline LLM driven with a Workload: one timed generate() call, its engine-stat delta and outputs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.stats import stats_delta
from bench.workload import Workload


@dataclass
class OfflineRun:
    seconds: float  # wall time of the generate() call alone
    cpu_seconds: float  # CPU time of the whole process (all threads) during the call: less sensitive to other load
    tokens: int  # generated tokens, counted from the outputs
    token_ids: list[list[int]]
    engine: dict[str, float]  # StatsSnapshot delta over the call (see bench.stats.stats_delta)
    outputs: list  # the RequestOutputs, for their metrics

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


class OfflineEngine:
    """An LLM serving `adapters` as LoRARequest(f"{prefix}{i}", i + 1, path): adapter index i of a Workload."""

    def __init__(
        self,
        model_dir: Path,
        adapters: Sequence[Path],
        *,
        num_threads: int | None,
        audit_url: str | None = None,
        max_loras: int = 8,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        name_prefix: str = "bench-",
        device: str = "cpu",
        dtype: str = "auto",
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        from loraledger import LLM, LoRARequest

        self.llm = LLM(
            model=str(model_dir),
            enable_lora=True,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            audit_url=audit_url,
            num_threads=num_threads,
            block_size=16,
            device=device,
            dtype=dtype,
            enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        self.loras = [LoRARequest(f"{name_prefix}{i}", i + 1, str(path)) for i, path in enumerate(adapters)]

    def register_all(self) -> float:
        """add_lora() every adapter (the host LRU keeps only max_cpu_loras of them); returns the seconds it took."""
        started = time.perf_counter()
        for lora in self.loras:
            self.llm.add_lora(lora)
        return time.perf_counter() - started

    def generate(self, workload: Workload) -> OfflineRun:
        from loraledger import SamplingParams

        prompts = [{"prompt_token_ids": p} for p in workload.prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
        loras = [None if a is None else self.loras[a] for a in workload.adapter_of]
        before = self.llm.get_stats()
        started, cpu_started = time.perf_counter(), time.process_time()
        outputs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)  # no bar inside the timed call
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        after = self.llm.get_stats()
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        return OfflineRun(
            seconds=seconds,
            cpu_seconds=cpu_seconds,
            tokens=sum(len(t) for t in token_ids),
            token_ids=token_ids,
            engine=stats_delta(before, after),
            outputs=outputs,
        )

    def close(self) -> None:
        self.llm.close()
