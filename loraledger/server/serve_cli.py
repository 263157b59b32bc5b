"""`loraledger serve` (vLLM's serve flags mapped to EngineArgs, plus keys and limits) and `loraledger keys add | list`."""

from __future__ import annotations

import argparse
import signal
import sys

SERVE_HELP = (
    "serve a model and its adapters over HTTP with OpenAI's and vLLM's routes, every caller authenticated and on record"
)


def register(sub) -> None:
    p = sub.add_parser("serve", help=SERVE_HELP, description=SERVE_HELP)
    p.add_argument("model", help="Hugging Face checkpoint folder, or Hub repo id org/name (Llama, Mistral or Qwen2)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the base model's name(s) in requests (default: the model path)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help='adapters served from start (vLLM\'s flag; also JSON {"name", "path"}) (default: none)',
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve adapters (default: on when --lora-modules or --lora-resolver is given; adapters loaded later need it)",
    )
    p.add_argument(
        "--lora-resolver",
        action="append",
        default=[],
        metavar="DIR|hf://ORG",
        help="load an adapter a request names on first use, from DIR/NAME or the Hub repo ORG/NAME[@rev] (only for keys "
        "allowed that name); repeatable, tried in order (default: none)",
    )
    p.add_argument(
        "--lora-resolver-max-loras",
        type=int,
        default=None,
        help="adapters each --lora-resolver may load at most (default: 64)",
    )
    p.add_argument("--max-loras", type=int, default=1, help="adapters on the device at once")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    p.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters cached in host memory (default: --max-loras)"
    )
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="KEYS.toml",
        help="the keys file (`loraledger keys add` makes it) (default: none: no keys, loopback only)",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve without keys on a non-loopback address: anyone who reaches it may use every model (default: off)",
    )
    p.add_argument(
        "--audit-url",
        default=None,
        help="audit database URL (default: $LORALEDGER_AUDIT_URL, else the engine's SQLite file)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--uds", default=None, help="a Unix domain socket to bind instead of host:port (default: none)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "half", "float16", "bfloat16", "float", "float32"),
        help="weight and compute dtype",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt plus output in tokens (default: the model's)"
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in the running batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step at most")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="CUDA: share of device memory the engine may use"
    )
    p.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="CPU: KV-cache size in bytes (default: the engine's sizing)"
    )
    p.add_argument("--seed", type=int, default=0, help="the engine's seed for unseeded requests")
    p.add_argument(
        "--start-timeout", type=float, default=600.0,
        help="seconds the engine may take to start (model read, weights loaded); then it exits with an error (default 600)",
    )  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: never replay CUDA graphs (default: off)")
    p.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn prefix caching off (default: on)",
    )
    p.add_argument("--max-logprobs", type=int, default=20, help="most logprobs a request may ask for")
    p.add_argument("--generation-config", default="auto", help="'auto' (the model folder's), 'vllm' (none) or a folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub repo id (default: the model's)")
    p.add_argument("--revision", default=None, help="the Hub model's branch, tag or commit (default: main)")
    p.add_argument(
        "--tokenizer-revision", default=None, help="the Hub tokenizer's branch, tag or commit (default: --revision)"
    )
    p.add_argument("--download-dir", default=None, help="the Hub cache folder (default: HF_HUB_CACHE / HF_HOME's)")
    p.add_argument("--tokenizer-mode", default="auto", choices=("auto", "slow"), help="fast or slow tokenizer")
    p.add_argument(
        "--quantization",
        default=None,
        help="the base model's quantization: gptq, awq, compressed-tensors, bitsandbytes or gguf (default: the checkpoint's)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted; code shipped with a checkpoint never runs (default: off)",
    )
    p.add_argument("--num-threads", type=int, default=None, help="CPU: torch threads (default: torch's choice)")
    p.add_argument(
        "--audit-prompts", default="text", choices=("text", "hash", "none"), help="what the audit log keeps of prompts"
    )
    p.add_argument(
        "--audit-timeout", type=float, default=5.0, help="seconds: the deadline of each audit-store operation"
    )
    p.add_argument(
        "--log-key", metavar="PEM", default=None,
        help="the Ed25519 key that signs receipts and checkpoints (default: $LORALEDGER_LOG_KEY, else one kept in the data folder)",
    )  # fmt: skip
    p.add_argument(
        "--audit-lease-seconds", type=float, default=30.0,
        help="seconds this engine's lease in a shared audit database lasts without renewal; peers recover it after (default 30)",
    )  # fmt: skip
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="request bodies above this are refused with 413 (default: 8 MiB)",
    )
    p.add_argument(
        "--max-pending-requests",
        type=int,
        default=None,
        help="requests in flight above which new ones get 503 (default: 4 x --max-num-seqs)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM; then they are aborted",
    )
    limits = p.add_argument_group("per-request limits (each over its bound: 400, 408 or 503)")
    limits.add_argument(
        "--max-stop-strings", type=int, default=64, help="`stop` strings, and `bad_words`, per request (default 64)"
    )
    limits.add_argument(
        "--max-stop-chars", type=int, default=8192, help="total characters of `stop`, and of `bad_words` (default 8192)"
    )
    limits.add_argument(
        "--max-token-id-list", type=int, default=4096,
        help="entries of `stop_token_ids` and of `allowed_token_ids` (default 4096)",
    )  # fmt: skip
    limits.add_argument("--max-logit-bias", type=int, default=1024, help="entries of `logit_bias` (default 1024)")
    limits.add_argument(
        "--max-rendered-chars", type=int, default=1 << 22,
        help="characters a chat conversation may render to (default 4194304)",
    )  # fmt: skip
    limits.add_argument(
        "--chat-template-timeout", type=float, default=5.0,
        help="seconds a request's own chat template may take to render (with --trust-request-chat-template) (default 5)",
    )  # fmt: skip
    limits.add_argument(
        "--body-timeout", type=float, default=30.0,
        help="seconds a request's body may take to arrive after its headers; then 408 (default 30)",
    )  # fmt: skip
    limits.add_argument(
        "--send-timeout", type=float, default=30.0,
        help="seconds each write of an answer may wait for the client to read; then the connection is closed and a "
        "stream aborted (default 30)",
    )  # fmt: skip
    limits.add_argument(
        "--max-body-readers", type=int, default=256,
        help="requests still sending their bodies at once; more get 503 (default 256)",
    )  # fmt: skip
    limits.add_argument(
        "--header-timeout", type=float, default=10.0,
        help="seconds a connection may take to send a request's headers; then it is closed (default 10)",
    )  # fmt: skip
    limits.add_argument(
        "--max-connections-per-client", type=int, default=256,
        help="open connections from one client address (behind a proxy: the proxy's); more are closed at once (default 256)",
    )  # fmt: skip
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat template, Jinja (default: off)",
    )
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='tool_choice "auto": parse the tool calls the model writes (needs --tool-call-parser) (default: off)',
    )  # fmt: skip
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="the format tool calls are parsed from: hermes, qwen, qwen3, llama3_json, mistral (default: none)",
    )
    p.add_argument("--root-path", default="", help="ASGI root path behind a proxy")
    p.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default=None,
        help="JSON log lines on stdout at this level and above (default: info)",
    )
    p.set_defaults(func=run_serve, json_logs=True)

    keys = sub.add_parser(
        "keys", help="API keys of `loraledger serve`: add, list", description="API keys of `loraledger serve`"
    )
    ksub = keys.add_subparsers(dest="keys_command", title="commands", metavar="COMMAND")
    add = ksub.add_parser(
        "add",
        help="make a key: prints it once; the file keeps its sha256",
        description="make a key: prints it once; the file keeps its sha256",
    )
    add.add_argument("--file", required=True, help="the keys file (made, mode 0600, if missing)")
    add.add_argument("--tenant", required=True, help="the tenant this key's requests are recorded under")
    add.add_argument(
        "--adapters",
        required=True,
        help="comma-separated model names or globs this key may use ('*': all; the base model by its served name)",
    )
    add.add_argument("--admin", action="store_true", help="may also load and unload adapters (default: a user key)")
    add.add_argument("--rate-limit", default=None, help="N/second, N/minute or N/hour (default: none)")
    add.set_defaults(func=run_keys_add)
    lst = ksub.add_parser(
        "list",
        help="the keys in a file: id, tenant, role, adapters, rate limit (never the keys)",
        description="list keys",
    )
    lst.add_argument("--file", required=True, help="the keys file")
    lst.set_defaults(func=run_keys_list)
    from loraledger.cli import show_help

    keys.set_defaults(func=show_help(keys))


def run_keys_add(args: argparse.Namespace) -> int:
    from loraledger.server.auth import add_key

    adapters = [a.strip() for a in args.adapters.split(",") if a.strip()]
    key_id, key = add_key(
        args.file, tenant=args.tenant, adapters=adapters, admin=args.admin, rate_limit=args.rate_limit
    )
    print(key)
    print(
        f"key {key_id} for tenant {args.tenant!r} added to {args.file}; the key is shown only now (the file keeps its sha256)",
        file=sys.stderr,
    )
    return 0


def run_keys_list(args: argparse.Namespace) -> int:
    from loraledger.server.auth import read_keys_file

    for k in read_keys_file(args.file):
        print(f"{k.key_id}\t{k.tenant}\t{k.role}\t{','.join(k.adapters)}\t{k.rate_limit or '-'}")
    return 0


def config_from_args(args: argparse.Namespace):
    from loraledger.cli import default_url
    from loraledger.engine_args import EngineArgs
    from loraledger.server.limits import ServerLimits
    from loraledger.server.lora_resolvers import DEFAULT_MAX_LORAS, LoRAResolverSpec
    from loraledger.server.server_config import DEFAULT_MAX_BODY_BYTES, LoRAModule, ServerConfig

    modules = tuple(LoRAModule.parse(text) for text in args.lora_modules)
    resolvers = tuple(LoRAResolverSpec.parse(text) for text in args.lora_resolver)
    engine_args = EngineArgs(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes, enable_prefix_caching=args.enable_prefix_caching,
        enable_lora=bool(args.enable_lora or modules or resolvers), max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, audit_url=args.audit_url or default_url(), audit_prompts=args.audit_prompts,
        audit_timeout=args.audit_timeout, audit_lease_seconds=args.audit_lease_seconds, num_threads=args.num_threads, enforce_eager=args.enforce_eager,
        log_key_file=args.log_key,
        max_logprobs=args.max_logprobs, generation_config=args.generation_config, tokenizer_mode=args.tokenizer_mode,
        trust_remote_code=args.trust_remote_code, gpu_memory_utilization=args.gpu_memory_utilization,
        revision=args.revision, tokenizer_revision=args.tokenizer_revision, download_dir=args.download_dir,
        start_timeout=args.start_timeout, quantization=args.quantization,
    )  # fmt: skip
    return ServerConfig(
        engine_args=engine_args,
        served_model_name=tuple(args.served_model_name or ()),
        lora_modules=modules,
        lora_resolvers=resolvers,
        lora_resolver_max_loras=(
            DEFAULT_MAX_LORAS if args.lora_resolver_max_loras is None else args.lora_resolver_max_loras
        ),
        api_keys_file=args.api_keys,
        insecure_no_auth=args.insecure_no_auth,
        host=args.host if args.uds is None else "127.0.0.1",
        max_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES,
        shutdown_grace_seconds=args.shutdown_grace,
        max_pending_requests=args.max_pending_requests,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        root_path=args.root_path,
        limits=ServerLimits(
            max_stop_strings=args.max_stop_strings,
            max_stop_chars=args.max_stop_chars,
            max_token_id_list=args.max_token_id_list,
            max_logit_bias=args.max_logit_bias,
            max_rendered_chars=args.max_rendered_chars,
            chat_template_seconds=args.chat_template_timeout,
            body_seconds=args.body_timeout,
            send_seconds=args.send_timeout,
            max_body_readers=args.max_body_readers,
            header_seconds=args.header_timeout,
            max_connections_per_client=args.max_connections_per_client,
        ),
    )


def run_serve(args: argparse.Namespace) -> int:
    from loraledger.server.logs import configure_json

    config = config_from_args(args)  # a refusal (an open address without keys) is printed before any log is set up
    log_config = configure_json(args.log_level or "info")
    return serve(config, port=args.port, uds=args.uds, log_config=log_config)


def serve(config, *, port: int, uds: str | None = None, log_config: dict | None = None, sockets=None) -> int:
    """Run the server until SIGTERM or SIGINT: then stop accepting, give running requests the grace period, abort the
    rest (on record as aborted), flush the audit log, and return 0. SIGHUP reloads the keys file."""
    import structlog
    import uvicorn

    from loraledger.server.app import build_app
    from loraledger.server.connections import uvicorn_options

    log = structlog.get_logger().bind(actor="server")
    app = build_app(config)
    state = app.state.server
    if config.api_keys_file is None:
        if config.insecure_no_auth:
            log.warning(
                "serving WITHOUT authentication (--insecure-no-auth): anyone who can reach this address may use every model",
                host=config.host,
            )
        else:
            log.warning("no --api-keys: serving on loopback only, without authentication", host=config.host)
    uv_config = uvicorn.Config(
        app, host=config.host, port=port, uds=uds, log_config=log_config, timeout_graceful_shutdown=config.shutdown_grace_seconds,
        access_log=True, proxy_headers=False, server_header=False, lifespan="on", **uvicorn_options(config.limits),
    )  # fmt: skip
    server = _Server(uv_config, on_exit=lambda sig: (state.mark_draining(), state.signals.post(sig)))
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, state.signals.post)  # the reload runs in a task, never in the handler
    server.run(sockets=sockets)
    return 0 if server.started else 1


class _Server:
    """uvicorn's Server, telling the app when shutdown begins, and exiting 0 on the signal that stopped it (uvicorn
    raises the signal again after shutting down, which would end the process with its default action)."""

    def __new__(cls, config, on_exit):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                # a signal handler: flags and a wake-up only (loraledger.server.signals says why)
                on_exit(sig)
                super().handle_exit(sig, frame)

            def capture_signals(self):
                import contextlib

                @contextlib.contextmanager
                def captured():
                    originals = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
                    try:
                        yield
                    finally:
                        for s, handler in originals.items():
                            signal.signal(s, handler)

                return captured()

        return Server(config)
