"""loraledger against vLLM's own CPU build, side by side: `python -m bench.run --only vs-vllm-cpu`.

Both engines run the bench model (Llama-shaped random model: hidden 512, 8 layers, vocab 32,000) and 6 of its
rank-16 adapters on all seven projections, each engine in a process of its own (bench/engine_worker.py; vLLM's
under the interpreter of its own venv, made on first use: bench/vllm_cpu_env.py, `--cache-dir`). The workloads
run by (dtype, LoRA on/off): that pair's two workers, one per engine, are up for all of its rounds and closed
before the next pair starts (one vLLM process at a time, ~2.5 GB each); every round runs each workload on both
engines, the engine order alternating between rounds, so a busy machine slows both alike: read the per-round
ratios. `--workloads` picks some of them (`--workloads big --big-dtypes bfloat16`: the 64 x 128 batch alone).
By default every round sends the same prompts, so from round 2 on a prefix cache holds them (ours does; vLLM 0.32's
CPU build gains nothing from its own); `--fresh-prompts` gives each round and workload prompts of its own (the same
for both engines), which is what a stream of new requests sees.

Workloads (greedy, ignore_eos): 24 prompts of 48 ids x 40 tokens as a mixed batch (6 adapters + base rows),
the same prompts with LoRA enabled and no adapter, with LoRA disabled; a bigger mixed batch (64 prompts x 128
tokens); at fp32 and bf16. Then the server path (bench/vs_vllm_server.py: 24 concurrent streaming clients
through each engine's OpenAI server) and the memory after load (a random model of SmolLM2-135M's shape at fp32 and bf16,
and its W4A16 copy).

Greedy ids are compared row by row on the rows where vLLM is correct: with every adapter slot full
(6 adapters, max_loras 6) vLLM's CPU build runs base-model rows through the last slot's adapter, so in the
mixed batches only the adapter rows are compared (the base rows are counted apart).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.bench_assets import model_assets
from bench.stats import median
from bench.vllm_cpu_env import cache_dir, vllm_env, vllm_python

WORKER = Path(__file__).resolve().parent / "engine_worker.py"
RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("loraledger", "vllm")
DTYPES = ("float32", "bfloat16")


class Worker:
    """One engine_worker.py process; every answer awaited with a deadline."""

    def __init__(self, python: str, args: list[str], env: dict | None, log_path: Path, timeout: float) -> None:
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [python, str(WORKER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
        )
        self.timeout = timeout
        self.ready = self._read()

    def _read(self) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(self.timeout):
            self.close()
            raise SystemExit(f"a worker gave no answer in {self.timeout:.0f} s; see {self.log.name}")
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker exited with {self.proc.wait()}; see {self.log.name}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def mixed_adapters(n: int) -> list[int | None]:
    """Adapters 0..5 and a base row in turn: 6 adapters + base."""
    return [None if i % 7 == 6 else i % 7 for i in range(n)]


def judged_rows(adapters: list[int | None]) -> tuple[list[int], list[int]]:
    """(the rows vLLM computes correctly, the base rows apart): with all 6 slots full its CPU build runs the base
    rows through the last slot's adapter."""
    full = len({a for a in adapters if a is not None}) >= 6
    judged = [i for i, a in enumerate(adapters) if not (full and a is None)]
    base = [i for i, a in enumerate(adapters) if full and a is None]
    return judged, base


def agreement(ours: list[list[int]], theirs: list[list[int]], adapters: list[int | None]) -> dict:
    """Rows whose greedy ids agree all the way, among the rows vLLM computes correctly (not the base rows of a
    batch whose slots are all full) and among those base rows apart."""
    judged, base = judged_rows(adapters)
    return {
        "judged_equal": sum(ours[i] == theirs[i] for i in judged),
        "judged": len(judged),
        "base_rows_equal": sum(ours[i] == theirs[i] for i in base),
        "base_rows": len(base),
    }


WORKLOADS = ("mixed", "no-adapter", "lora-off", "big")


def _worker(args, assets, python: Path, logs: Path, engine: str, dtype: str, lora: bool) -> Worker:
    cli = ["--engine", engine, "--model", str(assets.model_dir), "--dtype", dtype]
    cli += ["--threads", str(args.threads), "--max-num-seqs", str(max(64, args.big_prompts))]
    if lora:
        cli += ["--lora", "--max-loras", "6", "--rank", "16"]
        cli += [a for p in assets.adapters[:6] for a in ("--adapter", str(p))]
    py, env = (sys.executable, None) if engine == "loraledger" else (str(python), vllm_env(args.threads))
    print(f"starting {engine} {dtype} lora={lora}", flush=True)
    return Worker(py, cli, env, logs / f"{engine}-{dtype}-{'lora' if lora else 'base'}.log", args.timeout)


def run_batches(args, assets, python: Path, logs: Path) -> dict:
    """Every chosen workload, round by round, one (dtype, LoRA on/off) pair of workers up at a time: one vLLM
    process (about 2.5 GB with its smallest KV cache) and one of ours, not all eight at once."""
    small = prompts(args.prompts, args.prompt_len, assets.vocab_size, seed=0)
    big = prompts(args.big_prompts, args.prompt_len, assets.vocab_size, seed=1)
    runs = {  # key: (name, lora worker?, prompts, adapters, tokens, dtypes)
        "mixed": ("mixed (6 adapters + base)", True, small, mixed_adapters(len(small)), args.tokens, DTYPES),
        "no-adapter": ("LoRA enabled, no adapter", True, small, [None] * len(small), args.tokens, DTYPES),
        "lora-off": ("LoRA disabled", False, small, [None] * len(small), args.tokens, DTYPES),
        "big": (
            f"mixed, {len(big)} prompts x {args.big_tokens} tokens",
            True,
            big,
            mixed_adapters(len(big)),
            args.big_tokens,
            tuple(args.big_dtypes),
        ),
    }
    runs = {k: v for k, v in runs.items() if k in args.workloads}
    tps: dict[tuple, list[float]] = {}
    ids: dict[tuple, list[list[int]]] = {}
    for dtype in DTYPES:
        for lora in (True, False):
            group = [
                (name, ps, ads, tokens)
                for name, wl, ps, ads, tokens, dts in runs.values()
                if wl == lora and dtype in dts
            ]
            if not group:
                continue
            workers = {}
            try:
                for engine in ENGINES:
                    workers[engine] = _worker(args, assets, python, logs, engine, dtype, lora)
                for w in workers.values():  # warm-up: first-call allocations, oneDNN primitives, adapter loads
                    w.ask(prompts=small[:8], adapters=mixed_adapters(8) if lora else [None] * 8, max_tokens=4)
                for r in range(args.rounds):
                    order = ENGINES if r % 2 == 0 else ENGINES[::-1]
                    for k, (name, ps, ads, tokens) in enumerate(group):
                        if args.fresh_prompts:  # seeds apart from the fixed sets' (0, 1) and the warm-up's
                            ps = prompts(len(ps), len(ps[0]), assets.vocab_size, seed=1000 * (r + 1) + k)
                        for engine in order:
                            out = workers[engine].ask(prompts=ps, adapters=ads, max_tokens=tokens)
                            tps.setdefault((name, dtype, engine), []).append(out["tokens"] / out["seconds"])
                            # each figure as it comes: a run cut short still leaves its rounds in the log
                            print(
                                f"  round {r + 1} | {name} | {dtype} | {engine} | "
                                f"{tps[(name, dtype, engine)][-1]:,.1f} tok/s | load {os.getloadavg()[0]:.1f}",
                                flush=True,
                            )
                            ids[(name, dtype, engine)] = out["ids"]
                    print(f"{dtype} lora={lora}: round {r + 1}/{args.rounds} done", flush=True)
            finally:
                for w in workers.values():
                    w.close()
    table = {}
    for name, _, _, ads, _, dtypes in runs.values():
        for dtype in dtypes:
            ours, theirs = tps[(name, dtype, "loraledger")], tps[(name, dtype, "vllm")]
            table[f"{name} | {dtype}"] = {
                "loraledger": ours,
                "vllm": theirs,
                "ratios": [a / b for a, b in zip(ours, theirs)],
                "ids": agreement(ids[(name, dtype, "loraledger")], ids[(name, dtype, "vllm")], ads),
            }
    return table


def run_memory(args, python: Path, logs: Path, model_dir: Path) -> dict:
    """Resident memory of each engine's process tree right after load (no LoRA), and what it holds: the float model
    at fp32 and bf16, and its W4A16 copy (compressed-tensors pack-quantized, bench.quant_decode) with bf16
    activations. Weights: the checkpoint's fp32 bytes, half of them for bf16, and for W4A16 what our forward holds
    of it (packed projections, their scales, the bf16 embedding), counted from the loaded tensors."""
    from bench.quant_decode import resident_bytes, w4a16_checkpoint

    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))  # fp32 on disk
    quantized = w4a16_checkpoint(model_dir)
    forms = (
        ("float32", model_dir, "float32", weights),
        ("bfloat16", model_dir, "bfloat16", weights // 2),
        ("w4a16 (bf16 activations)", quantized, "bfloat16", resident_bytes(quantized, torch.bfloat16)["all"]),
    )
    out = {}
    for name, model, dtype, w_bytes in forms:
        for engine in ENGINES:
            cli = ["--engine", engine, "--model", str(model), "--dtype", dtype, "--threads", str(args.threads)]
            cli += ["--max-num-seqs", "64", "--max-model-len", "2048"]
            if engine == "loraledger":
                cli += ["--kv-cache-bytes", str(64 << 20)]
            py, env = (sys.executable, None) if engine == "loraledger" else (str(python), vllm_env(args.threads))
            tag = name.split()[0]
            w = Worker(py, cli, env, logs / f"memory-{engine}-{tag}.log", args.timeout)
            try:
                mem = w.ready["memory"]
                kv = w.ready.get("kv_cache_bytes")
            finally:
                w.close()
            out[f"{engine} | {name}"] = {"memory": mem, "weights_bytes": w_bytes, "kv_cache_bytes": kv}
    return out


def format_table(table: dict) -> str:
    lines = [
        "| workload | dtype | loraledger tok/s (median, range) | vLLM CPU tok/s (median, range) "
        "| loraledger / vLLM per round (median, range) | greedy ids equal (rows vLLM gets right; its base rows) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key, row in table.items():
        name, dtype = key.split(" | ")
        a, b, r, i = row["loraledger"], row["vllm"], row["ratios"], row["ids"]
        base = f"; {i['base_rows_equal']}/{i['base_rows']}" if i["base_rows"] else ""
        lines.append(
            f"| {name} | {dtype} | {median(a):,.0f} ({min(a):,.0f}-{max(a):,.0f}) | {median(b):,.0f} "
            f"({min(b):,.0f}-{max(b):,.0f}) | {median(r):.2f}x ({min(r):.2f}-{max(r):.2f}) "
            f"| {i['judged_equal']}/{i['judged']}{base} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run --only vs-vllm-cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--big-prompts", type=int, default=64)
    parser.add_argument("--big-tokens", type=int, default=128)
    parser.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="batches part: which workloads"
    )
    parser.add_argument("--big-dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument(
        "--fresh-prompts", action="store_true",
        help="batches part: new prompts every round and workload (no prefix-cache hits), the same for both engines",
    )  # fmt: skip
    parser.add_argument("--clients", type=int, default=24, help="server path: concurrent streaming clients")
    parser.add_argument("--server-dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--threads", type=int, default=2, help="each engine's threads (default 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds any one worker answer may take")
    parser.add_argument(
        "--cache-dir", default=None, help="where vLLM's venv lives (default: see bench/vllm_cpu_env.py)"
    )
    parser.add_argument(
        "--parts", nargs="+", choices=("batches", "server", "memory"), default=["batches", "server", "memory"]
    )
    parser.add_argument("--memory-model", type=Path, default=None, help="model for the memory part (default: a random "
                        "model of SmolLM2-135M's shape, built under the cache dir)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "vs-vllm-cpu.json")
    args = parser.parse_args(argv)
    cache = cache_dir(args.cache_dir)
    python = vllm_python(cache)
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    assets = model_assets()
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    started = time.perf_counter()
    if "batches" in args.parts:
        report["batches"] = run_batches(args, assets, python, logs)
        print(format_table(report["batches"]), flush=True)
    if "server" in args.parts:
        from bench.vs_vllm_server import format_server, run_server

        report["server"] = run_server(args, assets, python, logs)
        print(format_server(report["server"]), flush=True)
    if "memory" in args.parts:
        from bench.vs_vllm_server import format_memory, smollm2_shaped

        model = args.memory_model or smollm2_shaped(cache)
        report["memory"] = run_memory(args, python, logs, model)
        print(format_memory(report["memory"]), flush=True)
    report["seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {args.out} (worker logs under {logs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
