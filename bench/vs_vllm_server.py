"""The server path and the memory figures of bench.vs_vllm_cpu (`python -m bench.run --only vs-vllm-cpu`).

Server path: `loraledger serve` (no keys, SQLite audit on: its normal configuration) and vLLM's
`python -m vllm.entrypoints.openai.api_server`, both on 127.0.0.1 with the same model and 6 adapters; each round
24 clients (the openai package's AsyncOpenAI) stream one completion at once (48 prompt ids, 40 tokens, greedy,
6 adapters + base by turn) through one server, then through the other, the order alternating.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.stats import median
from bench.vllm_cpu_env import vllm_env

# SmolLM2-135M-Instruct's shape (its config.json), for the memory figures without a hub download
SMOLLM2_SHAPE = dict(
    arch="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    vocab_size=49_152,
    max_position_embeddings=2048,
    seed=7,
)


def smollm2_shaped(cache: Path) -> Path:
    """A random fp32 model of SmolLM2-135M's shape (tied embeddings as SmolLM2 has them), built once under `cache`."""
    from bench.bench_assets import build_once, write_tokenizer
    from loraledger.assets import build_random_checkpoint

    def write(out: Path) -> None:
        build_random_checkpoint(out, **SMOLLM2_SHAPE, tie_word_embeddings=True)
        write_tokenizer(out, SMOLLM2_SHAPE["vocab_size"])

    return build_once(cache / "smollm2-135m-shaped", write)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, engine: str, python: Path, assets, dtype: str, args, logs: Path, tmp: Path) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        modules = [f"a{i}={p}" for i, p in enumerate(assets.adapters[:6])]
        common = ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype, "--served-model-name", "base"]
        common += ["--lora-modules", *modules, "--max-loras", "6", "--max-lora-rank", "16", "--max-num-seqs", "64"]
        if engine == "loraledger":
            cmd = [sys.executable, "-m", "loraledger.cli", "serve", str(assets.model_dir), *common]
            cmd += ["--insecure-no-auth", "--audit-url", f"sqlite:///{tmp / 'audit.db'}"]
            cmd += ["--num-threads", str(args.threads), "--log-level", "warning"]
            env = None
        else:
            cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(assets.model_dir), *common]
            cmd += ["--enable-lora", "--max-model-len", "1024", "--enforce-eager", "--uvicorn-log-level", "warning"]
            env = vllm_env(args.threads)
        self.log = open(logs / f"server-{engine}-{dtype}.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_up(args.timeout)

    def _wait_up(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"a server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise SystemExit(f"a server did not come up in {timeout:.0f} s; see {self.log.name}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def _clients(url: str, prompts: list[list[int]], adapters: list[int | None], tokens: int, timeout: float) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=0)
    started = time.perf_counter()

    async def one(prompt: list[int], adapter: int | None) -> tuple[float, int]:
        stream = await client.completions.create(
            model="base" if adapter is None else f"a{adapter}",
            prompt=prompt,
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        first, used = None, 0
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - started
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return first or 0.0, used

    try:
        results = await asyncio.wait_for(asyncio.gather(*(one(p, a) for p, a in zip(prompts, adapters))), timeout)
    finally:
        await client.close()
    wall = time.perf_counter() - started
    tokens_done = sum(n for _, n in results)
    return {"tokens_per_s": tokens_done / wall, "tokens": tokens_done, "ttft_p50": median([t for t, _ in results])}


def run_server(args, assets, python: Path, logs: Path) -> dict:
    from bench.vs_vllm_cpu import ENGINES, mixed_adapters, prompts

    ps = prompts(args.clients, args.prompt_len, assets.vocab_size, seed=2)
    ads = mixed_adapters(len(ps))
    out = {}
    for dtype in args.server_dtypes:
        with tempfile.TemporaryDirectory(prefix="vs-vllm-server-") as tmp:
            servers = {}
            try:
                for engine in ENGINES:
                    print(f"starting the {engine} server ({dtype})", flush=True)
                    servers[engine] = Server(engine, python, assets, dtype, args, logs, Path(tmp))
                for s in servers.values():  # warm-up
                    asyncio.run(_clients(s.url, ps[:7], ads[:7], 4, args.timeout))
                runs = {e: [] for e in ENGINES}
                for r in range(args.rounds):
                    for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                        runs[engine].append(
                            asyncio.run(_clients(servers[engine].url, ps, ads, args.tokens, args.timeout))
                        )
            finally:
                for s in servers.values():
                    s.close()
        out[dtype] = runs
    return out


def format_server(report: dict) -> str:
    lines = [
        "| server path, 24 streaming clients (6 adapters + base) | dtype | loraledger tok/s | vLLM CPU tok/s "
        "| loraledger / vLLM per round | TTFT p50 loraledger / vLLM (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for dtype, runs in report.items():
        a = [r["tokens_per_s"] for r in runs["loraledger"]]
        b = [r["tokens_per_s"] for r in runs["vllm"]]
        ratios = [x / y for x, y in zip(a, b)]
        ta = median([r["ttft_p50"] for r in runs["loraledger"]])
        tb = median([r["ttft_p50"] for r in runs["vllm"]])
        lines.append(
            f"| openai client, streamed | {dtype} | {median(a):,.0f} ({min(a):,.0f}-{max(a):,.0f}) | {median(b):,.0f} "
            f"({min(b):,.0f}-{max(b):,.0f}) | {median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {ta:.2f} / {tb:.2f} |"
        )
    return "\n".join(lines)


def format_memory(report: dict) -> str:
    mib = 1 << 20
    lines = [
        "| memory after load (no LoRA) | resident MiB (anon + file) | weights MiB | KV cache MiB "
        "| resident - weights - KV (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, row in report.items():
        m, w, kv = row["memory"], row["weights_bytes"], row["kv_cache_bytes"] or 0
        lines.append(
            f"| {key} | {m['rss'] / mib:,.0f} ({m['anon'] / mib:,.0f} + {m['file'] / mib:,.0f}) | {w / mib:,.0f} "
            f"| {kv / mib:,.0f} | {(m['rss'] - w - kv) / mib:,.0f} |"
        )
    return "\n".join(lines)
