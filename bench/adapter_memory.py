"""Host memory of cached adapters: `python -m bench.run --only adapter-memory [--count N] [--max-lora-rank R]`.

Loads N of the churn benchmark's rank-8 adapters (all seven projections) the way the AdapterLoader
does, keeps them all (as its LRU of max_cpu_loras would), and reports what they hold: the
checkpoints' own count (`nbytes`), the process's resident memory growth, and the adapters' size on
disk for scale.
"""

from __future__ import annotations

import argparse
import gc
import resource

from bench.bench_assets import churn_adapters, model_assets


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main(argv: list[str] | None = None) -> int:
    from loraledger.gpu.model_config import ModelConfig
    from loraledger.lora.checkpoint_reader import load_lora_checkpoint

    parser = argparse.ArgumentParser(
        prog="python -m bench.run --only adapter-memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--count", type=int, default=64, help="adapters to keep loaded (default 64, the churn scenario's max_cpu_loras)"
    )
    parser.add_argument(
        "--max-lora-rank", type=int, default=8, help="the engine's max_lora_rank (default 8, the adapters' rank)"
    )
    args = parser.parse_args(argv)
    config = ModelConfig.from_pretrained(model_assets().model_dir)
    paths = churn_adapters(max(args.count, 1))[: args.count]
    on_disk = sum((p / "adapter_model.safetensors").stat().st_size for p in paths)
    gc.collect()
    before = _rss_bytes()
    kept = [
        load_lora_checkpoint(
            str(p), lora_name=f"m{i}", lora_int_id=i + 1, model_config=config, max_lora_rank=args.max_lora_rank
        )
        for i, p in enumerate(paths)
    ]
    gc.collect()
    grown = _rss_bytes() - before
    counted = sum(c.nbytes for c in kept)
    mib = 2**20
    print(
        f"{len(kept)} adapters (rank 8, max_lora_rank {args.max_lora_rank}): on disk {on_disk / mib:.1f} MiB, "
        f"checkpoints' nbytes {counted / mib:.1f} MiB, resident memory grew {grown / mib:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
