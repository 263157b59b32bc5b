"""HTTP vs in-process: the same streamed workload through `loraledger serve` (HTTP + API keys + audit) and through an
AsyncEngine in this process, in one run: throughput, p50/p99 time to first token, and their ratio.

Workload: `--requests` requests (default 128) of `--prompt-len` random token ids (64), `--max-tokens` new tokens each
(64, ignore_eos), bound round-robin to the bench model's 8 rank-16 adapters and the base model, kept at
`--concurrency` (32) streams at a time: a new request starts as soon as one ends. Every system streams (DELTA
outputs in process; server-sent events over HTTP, parsed by an httpx client in this process).

Systems, each started once and warmed up with one unmeasured round, then measured in interleaved rounds
(`--repeats`, default 3; medians reported):
- `in-process audit`: AsyncEngine with the SQLite audit store (the server's configuration);
- `in-process no audit`: the same with audit_url=None;
- `http`: `loraledger serve` in a subprocess (same EngineArgs, an API key file, SQLite audit), its
  `/v1/completions` streamed with `stream_options.include_usage`.
Throughput = generated tokens / wall seconds from the first request to the last byte. TTFT = from sending the
request to the first token arriving at the client (in process: to the first output with tokens).
Ratios: http / in-process audit (the cost of HTTP + auth) and http / in-process no audit (HTTP + auth + audit).
The server process and the client share the machine's cores with each other (on the reference machine: 2).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx

from bench.bench_assets import model_assets
from bench.stats import environment, median, percentiles
from bench.workload import batch_workload
from loraledger.engine_client import EngineClient

RESULTS = Path(__file__).resolve().parent / "results"


def _engine_args(assets, audit_url: str | None, threads: int, max_num_seqs: int):
    from loraledger import EngineArgs

    return EngineArgs(
        model=str(assets.model_dir), enable_lora=True, max_loras=8, max_lora_rank=16, max_num_seqs=max_num_seqs,
        audit_url=audit_url, num_threads=threads, seed=0,
    )  # fmt: skip


async def _closed_loop(n: int, concurrency: int, one) -> float:
    """Run one(i) for i in range(n) with at most `concurrency` at a time; returns the wall seconds."""
    limiter = anyio.Semaphore(concurrency)
    started = time.perf_counter()

    async def run(i: int) -> None:
        async with limiter:
            await one(i)

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(run, i)
    return time.perf_counter() - started


async def in_process(engine: EngineClient, loras, workload, args, measure: bool = True) -> dict:
    from loraledger import SamplingParams
    from loraledger.sampling_params import RequestOutputKind

    ttft, tokens = [], [0]

    async def one(i: int) -> None:
        a = workload.adapter_of[i]
        params = SamplingParams(
            max_tokens=workload.max_tokens[i],
            ignore_eos=True,
            temperature=0.8,
            seed=i,
            output_kind=RequestOutputKind.DELTA,
        )
        sent, first = time.perf_counter(), None
        lora = loras[a] if a is not None else None
        async for out in engine.generate(
            {"prompt_token_ids": workload.prompts[i]}, params, engine.new_request_id(), lora, tenant="bench"
        ):
            n = sum(len(c.token_ids) for c in out.outputs)
            if n and first is None:
                first = time.perf_counter() - sent
            tokens[0] += n
        ttft.append(first)

    wall = await _closed_loop(len(workload), args.concurrency, one)
    return {"tokens": tokens[0], "seconds": wall, "tokens_per_s": tokens[0] / wall, "ttft": percentiles(ttft)}


class Server:
    """`loraledger serve` in a subprocess with an API key, on 127.0.0.1."""

    def __init__(self, assets, audit_url: str, args, tmp: Path) -> None:
        from loraledger.server.auth import add_key

        _, self.key = add_key(tmp / "keys.toml", tenant="bench", adapters=["*"])
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        modules = [f"a{i}={p}" for i, p in enumerate(assets.adapters)]
        self.cmd = [
            sys.executable, "-m", "loraledger.cli", "serve", str(assets.model_dir), "--served-model-name", "base",
            "--lora-modules", *modules, "--max-loras", "8", "--max-lora-rank", "16", "--max-num-seqs", str(args.concurrency),
            "--api-keys", str(tmp / "keys.toml"), "--audit-url", audit_url, "--num-threads", str(args.threads),
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
        ]  # fmt: skip
        self.log = open(tmp / "server.log", "wb")

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"}
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit("the server did not come up in 300 s")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def over_http(http: httpx.AsyncClient, server: Server, workload, args) -> dict:
    ttft, tokens = [], [0]

    async def one(i: int) -> None:
        a = workload.adapter_of[i]
        body = {
            "model": f"a{a}" if a is not None else "base", "prompt": workload.prompts[i], "max_tokens": workload.max_tokens[i],
            "ignore_eos": True, "temperature": 0.8, "seed": i, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        sent, first, used = time.perf_counter(), None, 0
        async with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise SystemExit(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    used = chunk["usage"]["completion_tokens"]
                elif first is None and any(c["text"] for c in chunk["choices"]):
                    first = time.perf_counter() - sent
        tokens[0] += used
        ttft.append(first if first is not None else time.perf_counter() - sent)

    wall = await _closed_loop(len(workload), args.concurrency, one)
    return {"tokens": tokens[0], "seconds": wall, "tokens_per_s": tokens[0] / wall, "ttft": percentiles(ttft)}


async def _rounds(assets, server: Server, tmp: Path, args) -> dict[str, list[dict]]:
    """Both in-process engines and the server stay up for the whole run (each warmed up by one unmeasured round of
    the workload), and the rounds interleave the three systems."""
    from loraledger import AsyncEngine, LoRARequest

    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(assets.adapters)]
    runs: dict[str, list[dict]] = {"in-process audit": [], "in-process no audit": [], "http": []}
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    audited = AsyncEngine.from_engine_args(
        _engine_args(assets, f"sqlite:///{tmp / 'inproc.db'}", args.threads, args.concurrency)
    )
    plain = AsyncEngine.from_engine_args(_engine_args(assets, None, args.threads, args.concurrency))
    async with (
        audited,
        plain,
        httpx.AsyncClient(timeout=600, limits=limits, headers={"Authorization": f"Bearer {server.key}"}) as http,
    ):
        for engine in (audited, plain):
            for lora in loras:
                await engine.add_lora(lora)
        systems = {
            "in-process audit": lambda w: in_process(audited, loras, w, args),
            "in-process no audit": lambda w: in_process(plain, loras, w, args),
            "http": lambda w: over_http(http, server, w, args),
        }
        for r in range(args.repeats + 1):  # round 0: the warm-up, not reported
            workload = batch_workload(100 + r, num_prompts=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                                      vocab_size=assets.vocab_size, num_adapters=len(assets.adapters))  # fmt: skip
            for name, run in systems.items():
                result = await run(workload)
                if r > 0:
                    runs[name].append(result)
            if r > 0:
                print(
                    f"round {r}: " + ", ".join(f"{k} {v[-1]['tokens_per_s']:.0f} tok/s" for k, v in runs.items()),
                    file=sys.stderr,
                )
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run --only server", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128, help="requests per measured round")
    parser.add_argument("--concurrency", type=int, default=32, help="streams in flight at once")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt length in token ids")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (all generated: ignore_eos)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measured interleaved rounds of the three systems, after one warm-up round (medians reported)",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads of the engine (in process, and in the server)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "server.json")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    assets = model_assets()
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp_dir:
        tmp = Path(tmp_dir)
        env = environment()
        with Server(assets, f"sqlite:///{tmp / 'server-audit.db'}", args, tmp) as server:
            runs = anyio.run(_rounds, assets, server, tmp, args)
    summary = {
        name: {
            "tokens_per_s": median([x["tokens_per_s"] for x in xs]),
            "ttft_p50": median([x["ttft"]["p50"] for x in xs]),
            "ttft_p99": median([x["ttft"]["p99"] for x in xs]),
        }
        for name, xs in runs.items()
    }
    ratios = {
        "http / in-process audit (HTTP + auth)": summary["http"]["tokens_per_s"]
        / summary["in-process audit"]["tokens_per_s"],
        "http / in-process no audit (HTTP + auth + audit)": summary["http"]["tokens_per_s"]
        / summary["in-process no audit"]["tokens_per_s"],
    }
    print(
        f"\n{args.requests} requests x {args.max_tokens} tokens, {args.concurrency} concurrent streams, {args.repeats} rounds (medians)"
    )
    print(f"{'system':<22}{'tok/s':>10}{'TTFT p50':>12}{'TTFT p99':>12}")
    for name, s in summary.items():
        print(f"{name:<22}{s['tokens_per_s']:>10.0f}{s['ttft_p50']:>11.3f}s{s['ttft_p99']:>11.3f}s")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x (target >= 0.9x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "config": {k: str(v) for k, v in vars(args).items()},
                "runs": runs,
                "summary": summary,
                "ratios": ratios,
                "environment": env,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
