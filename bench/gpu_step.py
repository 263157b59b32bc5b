"""Decode and prefill steps against the bytes they must read, on a GPU: `python -m bench.gpu_step [--shape 1b 8b] [--json out.json]`.

Drives a ModelRunner directly (no actors) on Llama-shaped models with random bf16 weights made on
the GPU (no checkpoint files: an 8B-shaped model would take minutes to write and read back):
  1b  Llama-3.2-1B's shape: hidden 2048, 16 layers, 32/8 heads of 64, intermediate 8192, vocab 128,256, tied
  8b  Llama-3.1-8B's shape: hidden 4096, 32 layers, 32/8 heads of 128, intermediate 14,336, vocab 128,256
and 32 rank-16 adapters on all seven projections, put straight into the runner's 32 slots.

For each shape and decode batch (32, 64, 128: prompts of 128 tokens, then decode steps), with
adapters (sequence i bound to adapter i mod 32) and without:
  gpu_ms        the decode step's CUDA graph replayed alone (CUDA events, median of many replays)
  execute_ms    ModelRunner.execute, one step at a time, host clock: input fill, replay, sampling,
                token read-back
  overlapped_ms wall time per step of the same decode steps through the StepThread, each step's
                input ids taken on the device from the step before (PENDING_TOKEN), planned ahead
                as the overlapped Scheduler plans them; with the device's busy and idle time per
                step from the runner's CUDA events
  bytes         what a step must read: every weight once, the adapter rows of the slots in use, the
                KV cache of every sequence; the roofline is those bytes over the measured copy rate
and one prefill step of 32 prompts x 128 tokens (4,096 tokens) with 32 adapters and without.

`--quant`: the W4A16 comparison instead (bench/gpu_quant_step.py): the shape's projections 4-bit in the GPU's packed
layout, decode with 32 rank-16 adapters against its own no-adapter steps and against bf16 dense.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from bench.kernels import bench_copy, median_ms, no_gpu

SHAPES = {
    "1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128_256, tied=True),
    "8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128_256, tied=False),
}
NUM_ADAPTERS = 32
RANK = 16
PROMPT_LEN = 128
BLOCK = 16
BATCHES = (32, 64, 128)


def write_config(folder: Path, shape: dict) -> Path:
    """A Hugging Face config.json for the shape (all ModelRunner reads from the folder once weights are patched)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "vocab_size": shape["vocab"],
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": shape["tied"],
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def random_weights(config, dtype: torch.dtype, device: torch.device, seed: int = 7):
    """ModelWeights with normal(0, 1/sqrt(fan_in)) projections and unit norms, made on the device."""
    from loraledger.gpu.weights import LayerWeights, ModelWeights

    gen = torch.Generator(device=device).manual_seed(seed)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=gen, device=device, dtype=torch.float32) * in_f**-0.5).to(dtype)

    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    ones = torch.ones(h, dtype=dtype, device=device)
    layers = [
        LayerWeights(
            input_norm=ones,
            qkv=linear(q + 2 * kv, h),
            qkv_bias=None,
            o=linear(h, q),
            post_norm=ones,
            gate_up=linear(2 * inter, h),
            down=linear(h, inter),
        )
        for _ in range(config.num_hidden_layers)
    ]
    embed = (torch.randn(config.vocab_size, h, generator=gen, device=device) * 0.02).to(dtype)
    lm_head = embed if config.tie_word_embeddings else linear(config.vocab_size, h)
    return ModelWeights(embed=embed, layers=layers, norm=ones, lm_head=lm_head)


def random_adapter(config, slot: int, device: torch.device):
    """A stand-in for a loaded LoraCheckpoint: rank-RANK stacks for all seven projections, made on the device."""
    from loraledger.lora.slot_stacks import FUSED_MODULES, SlotStacks, fused_layout

    gen = torch.Generator(device=device).manual_seed(1000 + slot)
    groups = {}
    for group, modules in FUSED_MODULES.items():
        in_f, offsets = fused_layout(config, group)
        layers = config.num_hidden_layers
        a = torch.rand(layers, len(modules) * RANK, in_f, generator=gen, device=device).sub_(0.5).mul_(2 * in_f**-0.5)
        b = torch.randn(layers, offsets[-1], RANK, generator=gen, device=device).mul_(0.05)
        groups[group] = (a, b)
    stacks = SlotStacks(rank=RANK, scale=2.0, groups=groups, module_views={})
    return types.SimpleNamespace(slot_stacks=stacks, fingerprint=f"bench-adapter-{slot:02d}", rank=RANK)


def make_runner(shape_name: str, folder: Path, max_batch: int, max_len: int, weights=None):
    """A ModelRunner on the shape whose base weights are `weights(config, dtype, device)` (random_weights: bf16
    dense) instead of a checkpoint's."""
    import loraledger.gpu.model_runner as model_runner
    from loraledger.gpu.model_config import ModelConfig
    from loraledger.gpu.ops_cuda import CudaOps

    model_dir = write_config(folder / shape_name, SHAPES[shape_name])
    config = ModelConfig.from_pretrained(model_dir)
    device = torch.device("cuda", 0)
    per_seq = -(-max_len // BLOCK)
    make = weights or random_weights
    original = model_runner.base_model.load_base
    model_runner.base_model.load_base = lambda _dir, cfg, *, dtype, device, **_: make(cfg, dtype, device)
    try:
        runner = model_runner.ModelRunner(
            model_dir,
            dtype=torch.bfloat16,
            device=device,
            ops=CudaOps("cuda"),
            num_kv_blocks=max(max_batch, 32) * per_seq + 8,
            block_size=BLOCK,
            max_loras=NUM_ADAPTERS,
            max_lora_rank=RANK,
            enable_lora=True,
            max_num_batched_tokens=max(max_batch, 32) * PROMPT_LEN,
            max_model_len=max_len,
            cuda_graph_max_batch=max_batch,
        )
    finally:
        model_runner.base_model.load_base = original
    return runner, config


def step_bytes(config, batch: int, context: int, with_lora: bool) -> dict[str, int]:
    """Bytes one decode step must read: weights (the tied embedding once, as lm_head), adapter rows in use, KV cache."""
    shapes = config.module_shapes()
    per_layer = sum(i * o for i, o in shapes.values()) + 2 * config.hidden_size
    weights = 2 * (per_layer * config.num_hidden_layers + config.vocab_size * config.hidden_size + config.hidden_size)
    adapters = min(batch, NUM_ADAPTERS) if with_lora else 0
    lora = 2 * adapters * RANK * sum(i + o for i, o in shapes.values()) * config.num_hidden_layers
    kv = 2 * 2 * batch * context * config.kv_size * config.num_hidden_layers
    return {"weights": weights, "lora": lora, "kv": kv, "total": weights + lora + kv}


def run_shape(shape_name: str, folder: Path, steps: int, copy_gbps: float, log=print) -> dict:
    from loraledger.scheduling.step_plan import NewSeq, SamplingSpec, SeqWork, SlotLoad, StepPlan

    max_batch = max(BATCHES)
    max_len = PROMPT_LEN + 2 * steps + 16  # the one-at-a-time steps, then as many overlapped
    started = time.perf_counter()
    runner, config = make_runner(shape_name, folder, max_batch, max_len)
    log(f"{shape_name}: runner built in {time.perf_counter() - started:.1f} s")
    per_seq = -(-max_len // BLOCK)
    loads = [
        SlotLoad(slot=s, fingerprint=f"bench-adapter-{s:02d}", checkpoint=random_adapter(config, s, runner.device))
        for s in range(NUM_ADAPTERS)
    ]
    gen = torch.Generator().manual_seed(5)
    report: dict = {"shape": shape_name, **SHAPES[shape_name]}
    state = {"step": 0, "next_seq": 0}

    def execute(plan_kwargs: dict) -> tuple[object, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = runner.execute(StepPlan(state["step"], **plan_kwargs))  # noqa: F821 (bound above, before this closure runs)
        torch.cuda.synchronize()
        state["step"] += 1
        return out, time.perf_counter() - t0

    def new_batch(batch: int, with_lora: bool):
        ids = list(range(state["next_seq"], state["next_seq"] + batch))
        state["next_seq"] += batch
        tables = {sid: list(range(i * per_seq, (i + 1) * per_seq)) for i, sid in enumerate(ids)}
        prompts = torch.randint(4, config.vocab_size, (batch, PROMPT_LEN), generator=gen).tolist()
        slots = [i % NUM_ADAPTERS for i in range(batch)] if with_lora else [-1] * batch
        return ids, tables, prompts, slots

    def prefill(ids, tables, prompts, slots, extra=None) -> tuple[dict, float]:
        works = [SeqWork(sid, p, 0, tables[sid], slot, True) for sid, p, slot in zip(ids, prompts, slots)]
        news = [NewSeq(s, SamplingSpec(), p) for s, p in zip(ids, prompts)]
        out, seconds = execute({"seqs": works, "new_seqs": news, **(extra or {})})
        return {s.seq_id: s.token_id for s in out.sampled}, seconds

    # prefill: 32 prompts x 128 tokens in one step (4,096 tokens), the kernels warmed by a first run
    prefill_ms = {}
    for label, with_lora in (
        ("warm-up", True),
        ("32 adapters", True),
        ("no adapters", False),
        ("32 adapters again", True),
    ):
        ids, tables, prompts, slots = new_batch(32, with_lora)
        _, seconds = prefill(ids, tables, prompts, slots, {"slot_loads": loads} if label == "warm-up" else None)
        execute({"seqs": [], "freed_seq_ids": ids})
        if label != "warm-up":
            prefill_ms[label] = 1e3 * seconds
    report["prefill_4096"] = {
        "ms": prefill_ms,
        "adapters_over_base": statistics.mean([prefill_ms["32 adapters"], prefill_ms["32 adapters again"]])
        / prefill_ms["no adapters"],
    }
    log(f"{shape_name}: prefill of 4,096 tokens {prefill_ms}")

    rows = []
    for batch in BATCHES:
        for with_lora in (True, False):
            ids, tables, prompts, slots = new_batch(batch, with_lora)
            last, _ = prefill(ids, tables, prompts, slots)
            host = []
            for i in range(steps):
                works = [
                    SeqWork(sid, [last[sid]], PROMPT_LEN + i, tables[sid], slot, True) for sid, slot in zip(ids, slots)
                ]
                out, seconds = execute({"seqs": works})
                host.append(seconds)
                last = {s.seq_id: s.token_id for s in out.sampled}
            gpu = median_ms(runner.graphs.graph(batch, with_lora).replay, 5, 50)
            overlapped = run_overlapped(runner, state, ids, tables, slots, last, PROMPT_LEN + steps, steps)
            execute({"seqs": [], "freed_seq_ids": ids})
            nbytes = step_bytes(config, batch, PROMPT_LEN + steps, with_lora)
            roofline_ms = nbytes["total"] / copy_gbps / 1e6
            row = {
                "batch": batch,
                "adapters": NUM_ADAPTERS if with_lora else 0,
                "gpu_ms": gpu,
                "execute_ms": 1e3 * statistics.median(host[steps // 4 :]),
                "bytes": nbytes,
                "roofline_ms": roofline_ms,
                "gpu_pct_of_roofline": 100.0 * roofline_ms / gpu,
            }
            row["execute_pct_of_roofline"] = 100.0 * roofline_ms / row["execute_ms"]
            row.update(overlapped)
            row["overlapped_pct_of_roofline"] = 100.0 * roofline_ms / row["overlapped_ms"]
            rows.append(row)
            log(
                f"{shape_name} batch {batch:>3} {'32 adapters' if with_lora else 'no adapters':<11} GPU {gpu:.3f} ms "
                f"({row['gpu_pct_of_roofline']:.0f}% of roofline {roofline_ms:.3f} ms), execute {row['execute_ms']:.3f} ms, "
                f"overlapped {row['overlapped_ms']:.3f} ms/step ({row['overlapped_pct_of_roofline']:.0f}% of roofline, "
                f"device idle {100 * row['overlapped_idle_fraction']:.1f}%)"
            )
    report["decode"] = rows
    for batch in BATCHES:
        with_, without = (
            next(r for r in rows if r["batch"] == batch and (r["adapters"] > 0) == w) for w in (True, False)
        )
        report.setdefault("adapters_over_base_gpu", {})[batch] = without["gpu_ms"] / with_["gpu_ms"]
        report.setdefault("byte_ratio", {})[batch] = without["bytes"]["total"] / with_["bytes"]["total"]
    runner.close()
    del runner
    torch.cuda.empty_cache()
    return report


def run_overlapped(
    runner, state: dict, ids: list[int], tables: dict, slots: list[int], last: dict, start: int, steps: int
) -> dict:
    """`steps` decode steps from position `start` (first inputs: `last`), every plan handed to a StepThread at
    once, each after the first with PENDING_TOKEN inputs: each step is launched before the one before it is
    finished, its input ids taken on the device. Wall ms per step, and the device's busy and idle time per step
    from the runner's CUDA events (the first quarter of the steps left out)."""
    from loraledger.actors.step_thread import StepThread
    from loraledger.scheduling.step_plan import PENDING_TOKEN, SeqWork, StepPlan

    thread = StepThread(lambda: runner)
    thread.wait_ready()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(steps):
        works = [
            SeqWork(sid, [last[sid] if i == 0 else PENDING_TOKEN], start + i, tables[sid], slot, True)
            for sid, slot in zip(ids, slots)
        ]
        thread.submit(StepPlan(state["step"], seqs=works))
        state["step"] += 1
    thread.flush()
    done = [thread.results.get(timeout=600) for _ in range(steps)]
    seconds = time.perf_counter() - started
    thread.stop(timeout=60)
    failed = [d.error for d in done if d.error is not None]
    if failed:
        raise RuntimeError(f"an overlapped step failed: {failed[0]!r}")
    tail = [d.output for d in done[steps // 4 :]]
    busy = sum(o.gpu_seconds or 0.0 for o in tail)
    idle = sum(o.gpu_idle_seconds or 0.0 for o in tail)
    return {
        "overlapped_ms": 1e3 * seconds / steps,
        "overlapped_gpu_ms": 1e3 * busy / len(tail),
        "overlapped_idle_fraction": idle / (busy + idle) if busy + idle > 0 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_step", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["1b", "8b"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quant", action="store_true", help="the W4A16 vs bf16 decode comparison (gpu_quant_step)")
    parser.add_argument("--batch", type=int, nargs="+", help="--quant's decode batches (default 1 8 32)")
    args = parser.parse_args(argv)
    if no_gpu("bench.gpu_step"):
        return 2
    if args.quant:
        from bench.gpu_quant_step import run_quant

        return run_quant(args.shape, args.batch, args.steps, args.json)
    copy = bench_copy(5, 20)
    report = {"device": torch.cuda.get_device_name(), "copy_gbps": copy.gbps, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shape:
            report["shapes"][name] = run_shape(name, Path(tmp), args.steps, copy.gbps)
    print(f"device {report['device']}, copy {copy.gbps:.0f} GB/s")
    for name, r in report["shapes"].items():
        print(f"{name}: prefill 4096 tokens, 32 adapters / none: {r['prefill_4096']['adapters_over_base']:.2f}x time")
        for batch in BATCHES:
            print(
                f"{name} batch {batch}: no-adapter / 32-adapter GPU time {r['adapters_over_base_gpu'][batch]:.3f} (bytes ratio {r['byte_ratio'][batch]:.3f})"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
