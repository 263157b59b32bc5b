"""What one decode forward costs by batch size: `python -m bench.forward_sizes [--sizes 1,2,4,...] [--calls N]`.

Model.forward on the bench model (fp32, the CPU path) with 8 rank-8 churn adapters in the slots,
for decode batches of each size: every sequence on the base model, then every sequence on one of
the 8 adapters (round robin). A 64 MiB buffer is written between calls, so the weights come from
memory as they do in the engine, where each step streams all of them. Also timed: the base
projections alone (the pre-packed oneDNN GEMMs, `Dense`), inside the same calls.

Read the base column's smallest sizes as the fixed part of a step: what the churn run, with its
4-5x more and smaller steps than the 8-adapter run (`python -m bench.slot_sim`), pays again at
every step. Median over the calls; interleaved so that the machine's drift hits both columns.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.assets import churn_adapters, model_assets
from bench.patching import wrap


def churn_slot_runner(ops=None):
    """A CPU ModelRunner of the bench model with 8 rank-8 churn adapters loaded into its 8 slots."""
    from loraledger.gpu.lora_checkpoint import load_lora_checkpoint
    from loraledger.gpu.model_runner import ModelRunner
    from loraledger.gpu.ops_torch import TorchOps

    runner = ModelRunner(model_assets().model_dir, dtype=torch.float32, device=torch.device("cpu"), ops=ops or TorchOps(),
                         num_kv_blocks=1024, block_size=16, max_loras=8, max_lora_rank=8, enable_lora=True,
                         max_num_batched_tokens=2048)
    for slot, path in enumerate(churn_adapters(1000)[:8]):
        ckpt = load_lora_checkpoint(str(path), lora_name=f"c{slot}", lora_int_id=slot + 1, model_config=runner.config, max_lora_rank=8)
        runner.lora_slots.load(slot, ckpt)
    return runner


def decode_batch(runner, size: int, with_adapters: bool, *, first_context: int = 100, context_step: int = 5, prefill_tokens: int = 0):
    """`size` decode sequences (contexts first_context + i * context_step; slot i % 8 or the base model), optionally
    followed by one `prefill_tokens`-token prompt chunk on slot 3, as the runner would batch them."""
    from loraledger.gpu.forward_batch import build_forward_batch, order_for_batch
    from loraledger.gpu.step import SeqWork

    seqs = [SeqWork(i, [100 + i], first_context + context_step * i, list(range(i * 16, i * 16 + 16)), i % 8 if with_adapters else -1, True)
            for i in range(size)]
    if prefill_tokens:
        seqs.append(SeqWork(900, list(range(200, 200 + prefill_tokens)), 0, list(range(800, 800 + -(-prefill_tokens // 16))), 3, True))
    seqs, num_decode = order_for_batch(seqs)
    return build_forward_batch(seqs, num_decode, block_size=16, device=torch.device("cpu"), ops=runner.model.ops,
                               lora_slots=runner.lora_slots)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.forward_sizes", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8,12,16,24,32", help="decode batch sizes (default 1,2,4,8,12,16,24,32)")
    parser.add_argument("--calls", type=int, default=15, help="timed calls per size and column (default 15)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    runner = churn_slot_runner()
    gemm = [0.0]

    def timed_dense(call):
        def dense(self, x):
            started = time.perf_counter()
            try:
                return call(self, x)
            finally:
                gemm[0] += time.perf_counter() - started

        return dense

    wrap("loraledger.gpu.dense", "Dense.__call__", timed_dense)
    evict = torch.zeros(16 * 2**20)  # 64 MiB, twice the L3 cache
    print(f"Model.forward, ms per call (median of {args.calls}; base projections = the oneDNN GEMMs inside it)")
    print(f"{'batch':>5}  {'base model':>10}  {'of which GEMMs':>14}  {'8 adapters':>10}  {'of which GEMMs':>14}")
    with torch.inference_mode():
        for size in (int(s) for s in args.sizes.split(",")):
            batches = {side: decode_batch(runner, size, side == "lora") for side in ("base", "lora")}
            for b in batches.values():
                for _ in range(3):
                    runner.model.forward(b, runner.kv_cache)
            walls: dict[str, list[float]] = {"base": [], "lora": []}
            gemms: dict[str, list[float]] = {"base": [], "lora": []}
            for _ in range(args.calls):
                for side, b in batches.items():
                    evict.add_(1.0)
                    gemm[0] = 0.0
                    started = time.perf_counter()
                    runner.model.forward(b, runner.kv_cache)
                    walls[side].append(time.perf_counter() - started)
                    gemms[side].append(gemm[0])
            m = {k: statistics.median(v) * 1e3 for k, v in walls.items()}
            g = {k: statistics.median(v) * 1e3 for k, v in gemms.items()}
            print(f"{size:>5}  {m['base']:>10.2f}  {g['base']:>14.2f}  {m['lora']:>10.2f}  {g['lora']:>14.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
