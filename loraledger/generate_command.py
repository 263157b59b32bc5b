"""`loraledger generate`: run the engine on a user's checkpoint from the command line and show who wrote what."""

from __future__ import annotations

import argparse

AUDIT_URL_HELP = "audit database URL (default: $LORALEDGER_AUDIT_URL, else the engine's SQLite file; `loraledger db current` prints it)"
DEVICE_HELP = "where the model runs: auto picks CUDA when a GPU and CuPy are there"


def register(sub) -> None:
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
        help="weight and compute dtype; auto: bfloat16 on a CPU with AVX512-BF16 or AMX, else float32; the checkpoint's half precision on CUDA",
    )
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help=DEVICE_HELP)
    gen.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt plus output, in tokens (default: the model's)"
    )
    gen.add_argument("--audit-url", default=None, help=AUDIT_URL_HELP)
    gen.add_argument("--tenant", default=None, help="the tenant recorded with each request (default: none)")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send each prompt as a user turn rendered with the chat template, as LLM.chat "
        "(default: on when the model's tokenizer has a chat template)",
    )
    gen.set_defaults(func=run_generate)


def _audit_url(value: str | None) -> str:
    from loraledger.cli import default_url

    return value or default_url()


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
        lora_request = per_prompt if loras else None
        chat = args.chat if args.chat is not None else _has_chat_template(llm.get_tokenizer())
        if chat:
            conversations = [[{"role": "user", "content": p}] for p in prompts]
            outputs = llm.chat(conversations, params, lora_request=lora_request, tenant=args.tenant, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, lora_request=lora_request, tenant=args.tenant, use_tqdm=False)
    print_table(outputs, prompts)  # what was asked, not the chat template's rendering of it
    return 0


def _has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())  # one line, whatever the model wrote
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def print_table(outputs, prompts=None) -> None:
    """One row per output: audit key, adapter, fingerprint, finish, tokens, the prompt (cut) and the text (whole)."""
    # the audit key, whole: a UUIDv7's first characters are its time, shared by the requests of one batch
    rows = [("request id", "adapter", "fingerprint", "finish", "tokens", "prompt", "text")]
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        fp = (out.metrics.adapter_fingerprint or "") if out.metrics else ""
        rows.append(
            (
                out.audit_id or out.request_id,
                out.lora_request.lora_name if out.lora_request else "(base)",
                fp[:12] or "-",
                completion.finish_reason or "",
                str(len(completion.token_ids)),
                _one_line(prompts[i] if prompts is not None else out.prompt or "", 40),
                " ".join(completion.text.split()),  # whole, on one line
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
