"""W4A16 decode on a GPU with 32 rank-16 adapters, against its own no-adapter steps and against bf16 dense:
`python -m bench.gpu_step --quant [--shape 8b] [--batch 1 8 32] [--json out.json]`.

Two ModelRunners of the same Llama shape (bench/gpu_step.py's SHAPES), one at a time: bf16 dense projections, and
the projections 4-bit in the GPU's packed layout (group 128, symmetric, fp16 scales: GPTQ / compressed-tensors
W4A16's usual form) made at random on the device, which the Model runs through CudaOps.quant_linear (the GEMV up
to 8 tokens, dequantize + cuBLAS above). Embedding, norms and lm_head stay bf16 in both, as quantizers leave them.
Each decode batch (prompts of 128 tokens, then decode steps) runs with 32 adapters (sequence i on adapter i mod 32)
and without, CUDA graphs on; per (weights, batch, adapters):
  gpu_ms      the decode step's CUDA graph replayed alone (CUDA events, median)
  execute_ms  ModelRunner.execute, one step at a time, host clock (fill, replay, sampling, read-back)
  tokens_s    batch / execute time
and the ratios the quantized model is judged by, each from one run: W4A16 with 32 adapters over W4A16 without
(`adapters_over_base`, tokens/s), and W4A16 over bf16 dense, with adapters and without (`w4a16_over_bf16`).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_step import BLOCK, NUM_ADAPTERS, PROMPT_LEN, make_runner, random_adapter
from bench.kernels import median_ms

GROUP = 128
BATCHES = (1, 8, 32)


def random_w4a16(out_f: int, in_f: int, gen: torch.Generator, device: torch.device):
    """A random [out_f, in_f] 4-bit symmetric group-128 weight in the device layout, made on `device`: uniform
    nibbles, so (q - 8) * scale has about the spread of random_weights' normal(0, 1/sqrt(in_f))."""
    from loraledger.quantization.device_layout import DeviceQuantWeight

    words = torch.randint(-(2**31), 2**31 - 1, (out_f, in_f // 8), generator=gen, device=device, dtype=torch.int64)
    scales = torch.full((out_f, in_f // GROUP), in_f**-0.5 / 4.6, dtype=torch.float16, device=device)
    return DeviceQuantWeight(words.to(torch.int32), scales, None, None, 8.0, 4, GROUP, out_f, in_f)


def w4a16_weights(config, dtype: torch.dtype, device: torch.device, seed: int = 7):
    """ModelWeights whose projections are W4A16 device-layout parts; embedding, norms and lm_head as random_weights
    makes them (bf16)."""
    from loraledger.gpu.weights import LayerWeights, ModelWeights

    gen = torch.Generator(device=device).manual_seed(seed)
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    ones = torch.ones(h, dtype=dtype, device=device)
    layers = [
        LayerWeights(
            input_norm=ones,
            qkv=[random_w4a16(q + 2 * kv, h, gen, device)],
            qkv_bias=None,
            o=[random_w4a16(h, q, gen, device)],
            post_norm=ones,
            gate_up=[random_w4a16(2 * inter, h, gen, device)],
            down=[random_w4a16(h, inter, gen, device)],
        )
        for _ in range(config.num_hidden_layers)
    ]
    embed = (torch.randn(config.vocab_size, h, generator=gen, device=device) * 0.02).to(dtype)
    lm_head = embed
    if not config.tie_word_embeddings:
        lm_head = (torch.randn(config.vocab_size, h, generator=gen, device=device) * h**-0.5).to(dtype)
    return ModelWeights(embed=embed, layers=layers, norm=ones, lm_head=lm_head)


def ratios(rows: list[dict], batches) -> dict:
    """The figures the quantized model is judged by, from measured rows (see the module docstring)."""

    def tps(weights: str, batch: int, adapters: bool) -> float:
        return next(r for r in rows if (r["weights"], r["batch"], r["adapters"] > 0) == (weights, batch, adapters))[
            "tokens_s"
        ]

    return {
        "adapters_over_base": {b: tps("w4a16", b, True) / tps("w4a16", b, False) for b in batches},
        "w4a16_over_bf16": {
            b: {
                "32 adapters": tps("w4a16", b, True) / tps("bf16", b, True),
                "no adapters": tps("w4a16", b, False) / tps("bf16", b, False),
            }
            for b in batches
        },
    }


def measure(kind: str, shape: str, folder: Path, batches, steps: int, log=print) -> list[dict]:
    from loraledger.scheduling.step_plan import NewSeq, SamplingSpec, SeqWork, SlotLoad, StepPlan

    max_batch, max_len = max(batches), PROMPT_LEN + steps + 16
    started = time.perf_counter()
    runner, config = make_runner(shape, folder, max_batch, max_len, weights=w4a16_weights if kind == "w4a16" else None)
    log(
        f"{kind} {shape}: runner built in {time.perf_counter() - started:.1f} s, weights {runner.model.resident_weight_bytes() / 2**30:.2f} GiB"
    )
    per_seq = -(-max_len // BLOCK)
    loads = [
        SlotLoad(slot=s, fingerprint=f"bench-adapter-{s:02d}", checkpoint=random_adapter(config, s, runner.device))
        for s in range(NUM_ADAPTERS)
    ]
    gen = torch.Generator().manual_seed(5)
    step = {"id": 0, "seq": 0}

    def execute(**kw):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = runner.execute(StepPlan(step["id"], **kw))  # noqa: F821 (bound above, before this closure runs)
        torch.cuda.synchronize()
        step["id"] += 1
        return out, time.perf_counter() - t0

    rows = []
    for batch in batches:
        for with_lora in (True, False):
            ids = list(range(step["seq"], step["seq"] + batch))
            step["seq"] += batch
            tables = {sid: list(range(i * per_seq, (i + 1) * per_seq)) for i, sid in enumerate(ids)}
            prompts = torch.randint(4, config.vocab_size, (batch, PROMPT_LEN), generator=gen).tolist()
            slots = [i % NUM_ADAPTERS for i in range(batch)] if with_lora else [-1] * batch
            works = [SeqWork(sid, p, 0, tables[sid], slot, True) for sid, p, slot in zip(ids, prompts, slots)]
            news = [NewSeq(s, SamplingSpec(), p) for s, p in zip(ids, prompts)]
            extra = {"slot_loads": loads} if loads else {}
            out, _ = execute(seqs=works, new_seqs=news, **extra)
            loads = []
            last = {s.seq_id: s.token_id for s in out.sampled}
            host = []
            for i in range(steps):
                works = [
                    SeqWork(sid, [last[sid]], PROMPT_LEN + i, tables[sid], slot, True) for sid, slot in zip(ids, slots)
                ]
                out, seconds = execute(seqs=works)
                host.append(seconds)
                last = {s.seq_id: s.token_id for s in out.sampled}
            gpu = median_ms(runner.graphs.graph(batch, with_lora).replay, 5, 50)
            execute(seqs=[], freed_seq_ids=ids)
            execute_ms = 1e3 * statistics.median(host[steps // 4 :])
            row = {"weights": kind, "batch": batch, "adapters": NUM_ADAPTERS if with_lora else 0, "gpu_ms": gpu,
                   "execute_ms": execute_ms, "tokens_s": batch / execute_ms * 1e3}  # fmt: skip
            rows.append(row)
            log(f"{kind} {shape} batch {batch:>3} {'32 adapters' if with_lora else 'no adapters':<11} GPU {gpu:.3f} ms, "
                f"execute {execute_ms:.3f} ms, {row['tokens_s']:.0f} tokens/s")  # fmt: skip
    runner.close()
    del runner
    torch.cuda.empty_cache()
    return rows


def run_quant(shapes: list[str], batches: list[int] | None, steps: int, json_path: Path | None) -> int:
    batches = tuple(batches or BATCHES)
    report = {"device": torch.cuda.get_device_name(), "group": GROUP, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            rows = [r for kind in ("w4a16", "bf16") for r in measure(kind, shape, Path(tmp), batches, steps)]
            report["shapes"][shape] = {"rows": rows, **ratios(rows, batches)}
    print(f"device {report['device']}")
    for shape, r in report["shapes"].items():
        for b in batches:
            vs = r["w4a16_over_bf16"][b]
            print(f"{shape} batch {b}: W4A16 32 adapters / none {r['adapters_over_base'][b]:.3f} (tokens/s); "
                  f"W4A16 / bf16 {vs['32 adapters']:.3f} with 32 adapters, {vs['no adapters']:.3f} without")  # fmt: skip
    if json_path:
        json_path.write_text(json.dumps(report, indent=2))
    return 0
