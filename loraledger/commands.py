"""`loraledger demo` and `loraledger generate`: run the engine from the command line and show who wrote what."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

DEMO_VERSION = "demo-v1"
DEMO_ADAPTERS = {  # name -> (rank, alpha, target modules, seed)
    "sql": (8, 16.0, ("q_proj", "v_proj"), 11),
    "poet": (16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 12),
    "support": (4, 8.0, ("o_proj", "gate_proj", "down_proj"), 13),
}
DEMO_PROMPTS = [
    ("What is the capital of France?", None),
    ("Convert to SQL: all users older than 30", "sql"),
    ("Write a short poem about the sea", "poet"),
    ("My order has not arrived yet", "support"),
    ("Convert to SQL: count orders per day", "sql"),
    ("Tell me about the history of paper", None),
]


AUDIT_URL_HELP = "audit database URL (default: $LORALEDGER_AUDIT_URL, else the engine's SQLite file; `loraledger db current` prints it)"
DEVICE_HELP = "where the model runs: auto picks CUDA when a GPU and CuPy are there"


def register(sub) -> None:
    text = "build a small random model and three adapters locally (once), run one mixed batch, show who wrote what"
    demo = sub.add_parser("demo", help=text, description=text)
    demo.add_argument(
        "--cache-dir",
        default=None,
        help="where the demo model and adapters are built (default: loraledger's cache folder)",
    )
    demo.add_argument("--audit-url", default=None, help=AUDIT_URL_HELP)
    demo.add_argument("--max-tokens", type=int, default=24, help="tokens to generate per prompt")
    demo.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help=DEVICE_HELP)
    demo.add_argument(
        "--rebuild", action="store_true", help="rebuild the demo model and adapters (default: build once, then reuse)"
    )
    demo.set_defaults(func=run_demo)

    text = "generate with your own checkpoint: each prompt on the base model and on every adapter given"
    gen = sub.add_parser("generate", help=text, description=text)
    gen.add_argument(
        "--model",
        required=True,
        help="Hugging Face checkpoint folder, or Hub repo id org/name (Llama, Mistral or Qwen2)",
    )
    gen.add_argument("--revision", default=None, help="the Hub model's branch, tag or commit (default: main)")
    gen.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a PEFT adapter folder, or Hub repo id org/name[@revision]; repeatable (default: none, the base model only)",
    )
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeatable")
    gen.add_argument(
        "--only",
        default=None,
        metavar="NAME",
        help="run only this adapter ('base' for the base model) (default: the base model and every adapter)",
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, unseeded)")
    gen.add_argument("--max-lora-rank", type=int, default=64, help="the largest adapter rank the engine accepts")
    gen.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weight and compute dtype; auto: float32 on the CPU, the checkpoint's half precision on CUDA",
    )
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help=DEVICE_HELP)
    gen.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt plus output, in tokens (default: the model's)"
    )
    gen.add_argument("--audit-url", default=None, help=AUDIT_URL_HELP)
    gen.add_argument("--tenant", default=None, help="the tenant recorded with each request (default: none)")
    gen.set_defaults(func=run_generate)


def _audit_url(value: str | None) -> str:
    from loraledger.cli import default_url

    return value or default_url()


def demo_assets(cache_dir: Path, rebuild: bool = False) -> tuple[Path, dict[str, Path]]:
    """The demo's base model and adapters, built once with random weights (no download)."""
    from loraledger import assets

    root = cache_dir / DEMO_VERSION
    model_dir = root / "model"
    adapter_dirs = {name: root / "adapters" / name for name in DEMO_ADAPTERS}
    done = root / ".complete"
    if rebuild and root.exists():
        shutil.rmtree(root)
    if not done.exists():
        print(f"building the demo model and adapters under {root} (once) ...", file=sys.stderr)
        root.mkdir(parents=True, exist_ok=True)
        assets.build_tokenizer(model_dir, vocab_size=1024)
        assets.build_random_checkpoint(
            model_dir,
            arch="llama",
            hidden_size=256,
            intermediate_size=688,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            vocab_size=1024,
            max_position_embeddings=1024,
            seed=7,
        )
        for name, (rank, alpha, targets, seed) in DEMO_ADAPTERS.items():
            assets.build_random_adapter(
                adapter_dirs[name], model_dir, rank=rank, alpha=alpha, target_modules=list(targets), seed=seed
            )
        done.write_text("ok\n")
    return model_dir, adapter_dirs


def run_demo(args: argparse.Namespace) -> int:
    from loraledger import LLM, LoRARequest, SamplingParams, paths

    cache = Path(args.cache_dir) if args.cache_dir else paths.cache_dir()
    model_dir, adapter_dirs = demo_assets(cache, args.rebuild)
    url = _audit_url(args.audit_url)
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapter_dirs.items())}
    with LLM(
        model=str(model_dir),
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        max_cpu_loras=8,
        audit_url=url,
        device=args.device,
    ) as llm:
        outputs = llm.generate(
            [p for p, _ in DEMO_PROMPTS],
            SamplingParams(temperature=0, max_tokens=args.max_tokens),
            lora_request=[loras[a] if a else None for _, a in DEMO_PROMPTS],
            use_tqdm=False,
        )
    print("The demo model and its three adapters have random weights: the text is noise by design.")
    print("What matters is which adapter wrote each answer, and that every answer is on record.\n")
    _print_table(outputs)
    print(f"\naudit log: {url}")
    print("every row above is on record; look one up by its audit key (or any unique prefix of it), or check the log:")
    print(f"  loraledger audit show {outputs[0].audit_id}")
    print("  loraledger audit verify")
    print("or in SQL:")
    print("  SELECT r.request_id, r.lora_name, r.adapter_fingerprint, c.finish_reason, c.text")
    print("  FROM requests r JOIN completions c ON c.request_id = r.request_id ORDER BY r.received_at DESC LIMIT 6;")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from loraledger import LLM, LoRARequest, SamplingParams
    from loraledger.errors import ConfigError

    loras: dict[str, LoRARequest] = {}
    for i, spec in enumerate(args.lora):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora takes NAME=PATH, got {spec!r}")
        loras[name] = LoRARequest(name, i + 1, path)
    runs: list[LoRARequest | None] = [None, *loras.values()]
    if args.only is not None:
        if args.only != "base" and args.only not in loras:
            raise ConfigError(f"--only {args.only!r} names no --lora (known: {', '.join(['base', *loras])})")
        runs = [None] if args.only == "base" else [loras[args.only]]
    prompts = [p for _ in runs for p in args.prompt]
    per_prompt = [lora for lora in runs for _ in args.prompt]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    with LLM(
        model=args.model,
        revision=args.revision,
        enable_lora=bool(loras),
        max_loras=max(1, len(loras)),
        max_lora_rank=args.max_lora_rank,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        audit_url=_audit_url(args.audit_url),
    ) as llm:
        outputs = llm.generate(
            prompts, params, lora_request=per_prompt if loras else None, tenant=args.tenant, use_tqdm=False
        )
    _print_table(outputs)
    return 0


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())  # one line, whatever the model wrote
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _print_table(outputs) -> None:
    # the audit key, whole: a UUIDv7's first characters are its time, shared by the requests of one batch
    rows = [("request id", "adapter", "fingerprint", "finish", "tokens", "prompt", "text")]
    for out in outputs:
        completion = out.outputs[0]
        fp = (out.metrics.adapter_fingerprint or "") if out.metrics else ""
        rows.append(
            (
                out.audit_id or out.request_id,
                out.lora_request.lora_name if out.lora_request else "(base)",
                fp[:12] or "-",
                completion.finish_reason or "",
                str(len(completion.token_ids)),
                _one_line(out.prompt or "", 40),
                _one_line(completion.text, 40),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
