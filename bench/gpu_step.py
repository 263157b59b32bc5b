"""Where a batch-32 decode step's time goes on a GPU: `python -m bench.gpu_step [--json out.json]`.

Drives a ModelRunner directly (no actors) on bench.gpu_decode's 1B-shaped bf16 model with its 32
rank-16 adapters in 32 slots: one prefill of 32 prompts of 128 tokens, then decode steps. Reports,
per decode step, for 32 distinct adapters and for no adapters:
  gpu_ms      the CUDA graph's replay alone (CUDA events, median of many replays): the device work
  execute_ms  ModelRunner.execute (host clock): input fill + replay + sampling + token read-back
and the bytes a step must read (weights, adapter rows, KV cache) over gpu_ms, against the copy rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.gpu_decode import NUM_ADAPTERS, PROMPT_LEN, RANK, gpu_assets
from bench.kernels import bench_copy, median_ms, no_gpu

BATCH = 32
BLOCK = 16


def run(steps: int) -> dict:
    from loraledger.gpu.config import ModelConfig
    from loraledger.gpu.lora_checkpoint import load_lora_checkpoint
    from loraledger.gpu.model_runner import ModelRunner
    from loraledger.gpu.ops_cuda import CudaOps
    from loraledger.gpu.step import NewSeq, SamplingSpec, SeqWork, SlotLoad, StepPlan

    assets = gpu_assets()
    config = ModelConfig.from_pretrained(assets.model_dir)
    max_len = PROMPT_LEN + steps + 8
    per_seq = -(-max_len // BLOCK)
    runner = ModelRunner(
        assets.model_dir, dtype=torch.bfloat16, device=torch.device("cuda", 0), ops=CudaOps("cuda"),
        num_kv_blocks=2 * BATCH * per_seq, block_size=BLOCK, max_loras=NUM_ADAPTERS, max_lora_rank=RANK,
        enable_lora=True, max_num_batched_tokens=BATCH * PROMPT_LEN, max_model_len=max_len, cuda_graph_max_batch=BATCH,
    )
    loads = []
    for slot, path in enumerate(assets.adapters):
        ckpt = load_lora_checkpoint(str(path), lora_name=f"a{slot}", lora_int_id=slot + 1, model_config=config, max_lora_rank=RANK)
        loads.append(SlotLoad(slot=slot, fingerprint=ckpt.fingerprint, checkpoint=ckpt))
    gen = torch.Generator().manual_seed(5)
    report: dict = {"device": torch.cuda.get_device_name(), "batch": BATCH, "steps": steps}
    step_id = 0
    for label, with_lora in (("32 adapters", True), ("no adapters", False)):
        base_id = 1000 * (step_id + 1)
        ids = list(range(base_id, base_id + BATCH))
        tables = {sid: list(range(i * per_seq, (i + 1) * per_seq)) for i, sid in enumerate(ids)}
        prompts = torch.randint(4, config.vocab_size, (BATCH, PROMPT_LEN), generator=gen).tolist()
        slots = list(range(BATCH)) if with_lora else [-1] * BATCH
        spec = SamplingSpec()
        works = [SeqWork(sid, p, 0, tables[sid], slot, True) for sid, p, slot in zip(ids, prompts, slots)]
        plan_extra = {"slot_loads": loads} if step_id == 0 else {}
        out = runner.execute(StepPlan(step_id, seqs=works, new_seqs=[NewSeq(s, spec, p) for s, p in zip(ids, prompts)], **plan_extra))
        step_id += 1
        last = {s.seq_id: s.token_id for s in out.sampled}
        host = []
        for i in range(steps):
            works = [SeqWork(sid, [last[sid]], PROMPT_LEN + i, tables[sid], slot, True) for sid, slot in zip(ids, slots)]
            t0 = time.perf_counter()
            out = runner.execute(StepPlan(step_id, seqs=works))
            host.append(time.perf_counter() - t0)
            step_id += 1
            last = {s.seq_id: s.token_id for s in out.sampled}
        gpu = median_ms(runner.graphs.graph(BATCH, with_lora).replay, 5, 100)
        runner.execute(StepPlan(step_id, seqs=[], freed_seq_ids=ids))
        step_id += 1
        report[label] = {"gpu_ms": gpu, "execute_ms": 1e3 * statistics.median(host[steps // 4 :])}
    runner.close()
    params = sum(p for p in _param_counts(config).values())
    adapter_params = sum(RANK * (i + o) for i, o in config.module_shapes().values()) * config.num_hidden_layers
    report["base_bytes"] = 2 * params
    report["adapter_bytes_per_step"] = 2 * adapter_params * BATCH
    copy = bench_copy(5, 20)
    report["copy_gbps"] = copy.gbps
    for label, nbytes in (("32 adapters", report["base_bytes"] + report["adapter_bytes_per_step"]), ("no adapters", report["base_bytes"])):
        r = report[label]
        r["bytes"] = nbytes
        r["pct_of_copy"] = 100.0 * nbytes / (r["gpu_ms"] * 1e-3) / 1e9 / copy.gbps
    report["gpu_ratio"] = report["no adapters"]["gpu_ms"] / report["32 adapters"]["gpu_ms"]
    report["byte_ratio"] = report["base_bytes"] / (report["base_bytes"] + report["adapter_bytes_per_step"])
    return report


def _param_counts(config) -> dict[str, int]:
    """Parameters a decode step reads: every projection, the norms, and the (tied) embedding as lm_head."""
    layer = sum(i * o for i, o in config.module_shapes().values()) + 2 * config.hidden_size
    return {"layers": layer * config.num_hidden_layers, "lm_head": config.vocab_size * config.hidden_size}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_step", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if no_gpu("bench.gpu_step"):
        return 2
    report = run(args.steps)
    for label in ("32 adapters", "no adapters"):
        r = report[label]
        print(f"{label:<12} GPU {r['gpu_ms']:.3f} ms/step ({r['pct_of_copy']:.0f}% of copy rate for {r['bytes'] / 1e9:.2f} GB), execute {r['execute_ms']:.3f} ms")
    print(f"no-adapter / 32-adapter GPU time {report['gpu_ratio']:.3f}; bytes ratio {report['byte_ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
