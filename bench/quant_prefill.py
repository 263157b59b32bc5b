"""Prefill through a 4-bit base, the large-step path against the int4 kernel alone: `python -m bench.run --only quant-prefill`.

The bench model's compressed-tensors W4A16 checkpoint (bench/quant_decode.py) in two engines side by side, bf16, LoRA
on: one as served (layers take the dequantized dense product from LARGE_STEP_ROWS rows, loraledger/quantization/
int4pack_dense.py), one whose layers run torch's int4 kernel at every row count. Each round sends both the same fresh
prompts (no prefix-cache hits) of `--prompt-len` ids, 6 adapters + base rows mixed, one token each, so the time is the
prefill's; the engine order alternates. Prints seconds per round, the kernel-only / large-step ratio per round (median
and range) and whether the first generated ids agree.
"""

from __future__ import annotations

import argparse
import random
import time

from bench.bench_assets import model_assets
from bench.quant_decode import w4a16_checkpoint
from bench.stats import median
from loraledger import LLM, LoRARequest, SamplingParams
from loraledger.quantization import linear

ENGINES = ("large-step path", "int4 kernel only")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run --only quant-prefill", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per round (default 8)")
    parser.add_argument("--prompt-len", type=int, default=256, help="ids per prompt (default 256)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    args = parser.parse_args(argv)
    assets = model_assets()
    checkpoint = w4a16_checkpoint(assets.model_dir)
    served = linear.LARGE_STEP_ROWS
    engines = {}
    for name, rows in zip(ENGINES, (served, 1 << 62)):
        linear.LARGE_STEP_ROWS = rows  # read by each layer as it is built
        engines[name] = LLM(model=str(checkpoint), tokenizer=str(assets.model_dir), device="cpu", dtype="bfloat16",
                            audit_url=None, num_threads=args.threads, enable_lora=True, max_loras=6,
                            max_lora_rank=16)  # fmt: skip
    linear.LARGE_STEP_ROWS = served
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(assets.adapters[:6])]
    mixed = [None if i % 7 == 6 else loras[i % 7] for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    seconds: dict[str, list[float]] = {name: [] for name in ENGINES}
    agree = 0
    try:
        for e in engines.values():  # warm-up
            e.generate([{"prompt_token_ids": [5] * 8}], params)
        for r in range(args.rounds):
            prompts = [{"prompt_token_ids": [rng.randrange(4, assets.vocab_size) for _ in range(args.prompt_len)]}
                       for _ in range(args.prompts)]  # fmt: skip
            ids = {}
            for name in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                started = time.perf_counter()
                outs = engines[name].generate(prompts, params, lora_request=mixed)
                seconds[name].append(time.perf_counter() - started)
                ids[name] = [list(o.outputs[0].token_ids) for o in outs]
            agree += sum(a == b for a, b in zip(*ids.values()))
    finally:
        for e in engines.values():
            e.close()
    rows = args.prompts * args.prompt_len
    print(f"prefill of {args.prompts} x {args.prompt_len} ids ({rows} rows a step at most), {args.rounds} rounds:")
    for name in ENGINES:
        print(f"  {name}: {', '.join(f'{s:.3f}' for s in seconds[name])} s (median {median(seconds[name]):.3f})")
    ratio = [b / a for a, b in zip(*seconds.values())]
    print(f"int4 kernel only / large-step path: {median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})")
    print(f"first ids equal: {agree}/{args.rounds * args.prompts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
