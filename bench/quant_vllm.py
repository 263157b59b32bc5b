"""vLLM's CPU build as a column of `python -m bench.run --only quant`: the same quantized checkpoint, adapters and
prompts, in a process of its own (bench/engine_worker.py under the interpreter of vLLM's venv, bench/vllm_cpu_env.py).

vLLM 0.32 runs compressed-tensors W4A16 / GPTQ / AWQ on the CPU through `cpu_gemm_wna16`, built into its AVX512
library only: on an AVX2-only CPU its first forward fails, and the column says so instead of a figure. Greedy ids are
judged against a float32 reference (our engine on the same checkpoint, dequantized exactly at load) on the rows vLLM
computes correctly (bench.vs_vllm_cpu.agreement: with all 6 slots full its base rows run through an adapter).
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.vllm_cpu_env import cache_dir, vllm_env, vllm_python
from bench.vs_vllm_cpu import RESULTS, Worker, agreement, judged_rows

NAME = "vllm-w4a16"


def start(checkpoint: Path, adapters: list[Path], threads: int, timeout: float = 900.0) -> Worker:
    """vLLM's engine on `checkpoint` in bf16 with LoRA on (6 slots, rank 16), ready to generate."""
    python = vllm_python(cache_dir())
    cli = ["--engine", "vllm", "--model", str(checkpoint), "--dtype", "bfloat16", "--threads", str(threads)]
    cli += ["--lora", "--max-loras", "6", "--rank", "16", "--max-num-seqs", "64"]
    cli += [a for p in adapters[:6] for a in ("--adapter", str(p))]
    RESULTS.mkdir(parents=True, exist_ok=True)
    print(f"starting vLLM's CPU build on {checkpoint.name} (log: {RESULTS / 'quant-vllm.log'})", flush=True)
    return Worker(str(python), cli, vllm_env(threads), RESULTS / "quant-vllm.log", timeout)


def generate(worker: Worker, prompts: list[list[int]], adapters: list[int | None], tokens: int) -> tuple[float, list]:
    """(tokens per second as the worker timed its generate call, the greedy ids per row)."""
    answer = worker.ask(prompts=prompts, adapters=adapters, max_tokens=tokens)
    return answer["tokens"] / answer["seconds"], answer["ids"]


def judge(reference: list[list[int]], rows: dict[str, list[list[int]]], adapters: list[int | None]) -> dict:
    """Per engine: rows whose ids equal the fp32 reference all the way, and the mean length of the agreeing prefix,
    over the rows vLLM computes correctly."""
    out = {}
    judged, _ = judged_rows(adapters)
    for name, ids in rows.items():
        counts = agreement(ids, reference, adapters)
        prefixes = [_prefix(ids[i], reference[i]) for i in judged]
        out[name] = {**counts, "mean_prefix": sum(prefixes) / max(len(prefixes), 1)}
    return out


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def print_agreement(result: dict, tokens: int) -> None:
    print(f"| engine | rows equal to the fp32 reference ({tokens} ids) | mean agreeing prefix | base rows apart |")
    print("|---|---:|---:|---:|")
    for name, r in result.items():
        print(f"| {name} | {r['judged_equal']}/{r['judged']} | {r['mean_prefix']:.1f} "
              f"| {r['base_rows_equal']}/{r['base_rows']} |")  # fmt: skip
    sys.stdout.flush()
