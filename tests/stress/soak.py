"""Memory soak: many rounds of concurrent requests on the tiny model, resident memory after each round.

    python -m tests.stress.soak                       # 8,000 warm-up + 20,000 requests, 1,000 at a time, audit off
    python -m tests.stress.soak --requests 5000 --audit sqlite --no-prefix-caching

Prints one line per round (requests done, resident MiB) and a summary: resident memory after the
warm-up rounds, at the end, and the growth over the --requests after warm-up. Exit status 1 when
the growth is above --max-growth-mib. `run_soak` runs it in-process.

What the warm-up covers: the CPU path's projections compile one oneDNN primitive per row count
they see (gpu/dense.py bounds those to 37 sizes per projection, at most ~185 primitives of ~0.6 MiB
each), and traffic reaches the rarer sizes only over the first few thousand requests; memory grows
until then and is flat afterwards. The default warm-up is long enough for this traffic to have
seen them; a shorter one (--warmup 2000) measures some of that bounded growth too.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio


def resident_mib() -> float:
    """This process's resident set size in MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


@dataclass
class SoakResult:
    rounds: list[tuple[int, float]] = field(default_factory=list)  # (requests done, resident MiB) after each round
    warm_mib: float = 0.0
    end_mib: float = 0.0
    seconds: float = 0.0

    @property
    def growth_mib(self) -> float:
        return self.end_mib - self.warm_mib


def _requests(rng: random.Random, count: int, vocab: int) -> list[tuple[dict, dict]]:
    """Prompts of varied lengths and sampling settings: every step has a different shape."""
    out = []
    for _ in range(count):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 48))]
        params = dict(max_tokens=rng.randint(2, 24), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1 << 30))
        if rng.random() < 0.1:
            params["n"] = rng.randint(2, 4)
            params["temperature"] = 0.8  # greedy allows n=1 only (vLLM's rule)
        if rng.random() < 0.1:
            params["logprobs"] = rng.randint(0, 3)
        out.append(({"prompt_token_ids": prompt}, params))
    return out


async def _soak(args, model_dir: Path, audit_url: str | None, log) -> SoakResult:
    from loraledger import AsyncEngine, EngineArgs, SamplingParams

    engine_args = EngineArgs(
        model=str(model_dir),
        audit_url=audit_url,
        enable_prefix_caching=args.prefix_caching,
        block_size=16,
        max_num_seqs=256,
        seed=0,
    )
    result = SoakResult()
    rng = random.Random(args.seed)
    started = time.perf_counter()
    async with AsyncEngine.from_engine_args(engine_args) as engine:
        result.warm_mib = resident_mib()
        vocab = engine.model_config.vocab_size
        done = 0
        round_no = 0
        total = args.warmup + args.requests
        while done < total:
            count = min(args.concurrency, total - done)
            batch = _requests(rng, count, vocab)

            async def one(i: int) -> None:
                prompt, params = batch[i]
                async for _ in engine.generate(prompt, SamplingParams(**params)):
                    pass

            async with anyio.create_task_group() as tg:
                for i in range(count):
                    tg.start_soon(one, i)
            done += count
            round_no += 1
            gc.collect()
            rss = resident_mib()
            result.rounds.append((done, rss))
            if done <= args.warmup:
                result.warm_mib = rss
            log(f"round {round_no:3d}: {done:6d} requests, resident {rss:8.1f} MiB")
        result.end_mib = result.rounds[-1][1]
    result.seconds = time.perf_counter() - started
    return result


def run_soak(
    model_dir: Path,
    *,
    requests: int,
    concurrency: int,
    warmup: int,
    audit_url: str | None = None,
    prefix_caching: bool = True,
    seed: int = 0,
    log=lambda line: None,
) -> SoakResult:
    args = argparse.Namespace(
        requests=requests, concurrency=concurrency, warmup=warmup, prefix_caching=prefix_caching, seed=seed
    )
    return anyio.run(_soak, args, model_dir, audit_url, log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress.soak", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=20_000, help="requests measured after the warm-up (default 20000)"
    )
    parser.add_argument("--concurrency", type=int, default=1_000, help="requests in flight per round (default 1000)")
    parser.add_argument(
        "--warmup", type=int, default=8_000, help="requests run before the baseline is taken (default 8000)"
    )
    parser.add_argument(
        "--audit",
        choices=("off", "sqlite"),
        default="off",
        help="audit log: off, or a SQLite file in a temporary folder (default off)",
    )
    parser.add_argument(
        "--no-prefix-caching", dest="prefix_caching", action="store_false", help="turn prefix caching off"
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model folder (default: build the tiny test model in a temporary folder)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-growth-mib", type=float, default=20.0, help="exit 1 above this growth after warm-up (default 20)"
    )
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="loraledger-soak-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from tests.model_fixtures import build_tiny_model

            model_dir = build_tiny_model(Path(tmp), "llama", seed=1).model_dir
        audit_url = None if args.audit == "off" else f"sqlite:///{tmp}/audit.sqlite3"
        print(
            f"soak: {args.requests} requests, {args.concurrency} at a time, audit {args.audit}, "
            f"prefix caching {'on' if args.prefix_caching else 'off'}, model {model_dir}",
            flush=True,
        )
        result = run_soak(
            model_dir,
            requests=args.requests,
            concurrency=args.concurrency,
            warmup=args.warmup,
            audit_url=audit_url,
            prefix_caching=args.prefix_caching,
            seed=args.seed,
            log=lambda line: print(line, flush=True),
        )
    print(
        f"resident after warm-up ({args.warmup} requests): {result.warm_mib:.1f} MiB; at the end: {result.end_mib:.1f} MiB; "
        f"growth {result.growth_mib:+.1f} MiB over {args.requests} requests ({result.seconds:.0f} s)"
    )
    return 0 if result.growth_mib <= args.max_growth_mib else 1


if __name__ == "__main__":
    sys.exit(main())
