"""Turns EngineArgs into an EngineSetup: backend and dtype choice, tokenizers, model and generation config, KV-cache size, audit store."""

from __future__ import annotations

import functools
from pathlib import Path

import msgspec
import torch

from loraledger.actors.engine_core import EngineSetup
from loraledger.engine_args import DEFAULT_AUDIT_URL, EngineArgs
from loraledger.errors import ConfigError, EngineStartError, ModelLoadError
from loraledger.generation_config import read_generation_config
from loraledger.gpu import cpu_features
from loraledger.gpu.model_config import ModelConfig
from loraledger.logging import get_logger
from loraledger.quantization.scheme import QuantScheme
from loraledger.sources.engine_sources import instance_fields, quantization_fields, resolve_model
from loraledger.tokenizer_group import TokenizerGroup, load_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_KV_BYTES = {"cpu": 256 << 20, "cuda": 8 << 30}

log = get_logger("engine_setup")


def resolve_dtype(requested: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """`requested` is EngineArgs.torch_dtype_name (vLLM's aliases resolved). "auto" on the CPU: bfloat16 where the CPU
    multiplies bf16 natively (AVX512-BF16 or AMX), float32 elsewhere (emulated bf16 is slower than fp32); on CUDA the
    checkpoint's float16, else bfloat16 (vLLM picks float16 for a float32 checkpoint: README, Differences from vLLM).
    An explicit bfloat16 on a CPU that emulates it is honoured, with a warning naming the cost and the fix."""
    if requested != "auto":
        if requested == "bfloat16" and device.type == "cpu" and not cpu_features.native_bf16():
            log.warning(
                "dtype=bfloat16 on a CPU without native bf16 (AVX512-BF16 or AMX): bf16 is emulated here, about 4x "
                "slower than float32 on such a CPU (bench/RESULTS.md, CPU vs vLLM)",
                hint="pass dtype='auto' or 'float32', which run float32 on this CPU",
            )
        return _DTYPES[requested]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_features.native_bf16() else torch.float32
    saved = (config.torch_dtype or "").replace("torch.", "")
    return torch.float16 if saved == "float16" else torch.bfloat16


def prepare(args: EngineArgs) -> EngineSetup:
    """Everything slow or fallible that must happen before the actors start (runs in a worker thread)."""
    from loraledger.gpu import base_model
    from loraledger.gpu.backend import select_backend
    from loraledger.gpu.gguf_weights import is_gguf
    from loraledger.gpu.heap import keep_freed_memory
    from loraledger.gpu.kv_cache import KVCache
    from loraledger.gpu.model_runner import ModelRunner

    model_source, tokenizer_source = resolve_model(args)  # a Hub repo id: fetched, under its deadline and size limit
    model_dir = Path(model_source.folder)
    gguf = is_gguf(model_dir) and model_dir.is_file()
    if not model_dir.is_dir() and not gguf:
        raise ModelLoadError(
            f"model folder {str(model_dir)!r} does not exist; pass the path of a Hugging Face checkpoint folder, a "
            ".gguf file or a Hub repo id (org/name)"
        )
    if gguf and tokenizer_source is not None and tokenizer_source.folder == model_source.folder:
        raise ConfigError(
            f"a GGUF model needs its tokenizer named: pass tokenizer= (--tokenizer) with {model_dir.name}"
        )
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    quantization = base_model.read_quantization(model_dir, args.quantization)
    if quantization is None:
        refuse_unimplemented_weights(model_dir)
    ops, device = select_backend(args.device)
    if device.type == "cpu":
        keep_freed_memory()  # before the step thread starts (gpu/heap.py says why)
    config = base_model.read_config(model_dir)
    config.check_device(device.type)
    base_model.check_device(quantization, device)
    dtype = resolve_dtype(args.torch_dtype_name, config, device)
    max_model_len = args.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={config.max_position_embeddings}; "
            "lower max_model_len"
        )
    if not args.chunked_prefill and args.max_num_batched_tokens < max_model_len:
        # vLLM's rule: without chunks a prompt runs in one step, so the step's token budget must hold the longest one
        raise ConfigError(
            f"max_num_batched_tokens ({args.max_num_batched_tokens}) is smaller than max_model_len ({max_model_len}) with "
            "enable_chunked_prefill=False, so a long prompt could never run; raise max_num_batched_tokens, lower "
            "max_model_len, or leave chunked prefill on"
        )
    tokenizer = None if tokenizer_source is None else load_tokenizer(tokenizer_source.folder, mode=args.tokenizer_mode)
    generation = read_generation_config(model_dir, args.generation_config)
    per_block = KVCache.bytes_per_block(config, args.block_size, dtype)
    graph_batch = 0 if args.enforce_eager or device.type != "cuda" else min(args.max_num_seqs, 256)
    if args.num_kv_blocks is not None:
        num_blocks = args.num_kv_blocks
    else:
        if args.kv_cache_bytes is not None:
            budget = args.kv_cache_bytes
        elif device.type == "cuda":
            budget = _cuda_kv_budget(args, config, model_dir, dtype, device, graph_batch, quantization)
        else:  # the CPU: gpu_memory_utilization does not apply (the machine's memory is not the engine's alone)
            wanted = args.max_num_seqs * -(-max_model_len // args.block_size) * per_block
            budget = min(wanted, _DEFAULT_KV_BYTES[device.type])
        num_blocks = max(1, budget // per_block)
    if num_blocks * args.block_size < max_model_len // 8 and num_blocks < 2:
        raise ConfigError(f"the KV cache holds only {num_blocks} block(s); raise num_kv_blocks or kv_cache_bytes")
    max_model_len = fit_max_model_len(args, max_model_len, num_blocks, config)
    fingerprint = base_model.fingerprint(model_dir, quantization)
    quant = quantization_fields(quantization, base_model.source_fingerprint(model_dir, quantization))
    store = open_store(args, {**instance_fields(model_source, tokenizer_source), **quant})
    make_runner = functools.partial(
        ModelRunner,
        str(model_dir),
        dtype=dtype,
        device=device,
        ops=ops,
        num_kv_blocks=num_blocks,
        block_size=args.block_size,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        enable_lora=args.enable_lora,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        cuda_graph_max_batch=graph_batch,
        cuda_graph_max_len=min(max_model_len, args.max_seq_len_to_capture),
        quantization=quantization,
    )
    log.info(
        "engine prepared",
        model=str(model_dir),
        device=str(device),
        dtype=str(dtype),
        kv_blocks=num_blocks,
        block_size=args.block_size,
        max_model_len=max_model_len,
        quantization=None if quantization is None else quantization.describe(),
        audit=store is not None,
    )
    return EngineSetup(
        args=args,
        model_config=config,
        tokenizer=tokenizer,
        tokenizers=TokenizerGroup(
            tokenizer, vocab_size=config.vocab_size, mode=args.tokenizer_mode, capacity=max(8, args.cpu_lora_capacity)
        ),
        generation=generation,
        max_model_len=max_model_len,
        num_kv_blocks=num_blocks,
        base_model_fingerprint=fingerprint,
        make_runner=make_runner,
        store=store,
        async_scheduling=args.async_scheduling if args.async_scheduling is not None else device.type == "cuda",
        max_n=args.resolved_max_n(num_blocks),
    )


def fit_max_model_len(args: EngineArgs, max_model_len: int, num_blocks: int, config: ModelConfig) -> int:
    """The rule between max_model_len and the KV cache: one sequence of max_model_len tokens must fit in the cache,
    or a request could be admitted that never runs (waiting forever at 0% cache use) and a generation could stall at
    the cache's edge. A max_model_len the caller set that does not fit refuses to start, as in vLLM; the model's own
    (max_position_embeddings, taken when max_model_len is left out) is lowered to what the cache holds, and the log
    says so, because refusing would make the CPU's default cache (256 MiB) unable to serve most models as they ship."""
    capacity = num_blocks * args.block_size
    if capacity >= max_model_len:
        return max_model_len
    if args.max_model_len is not None:
        raise ConfigError(
            f"max_model_len={max_model_len} tokens do not fit in the KV cache, which holds {capacity} tokens "
            f"({num_blocks} blocks of {args.block_size}); raise kv_cache_bytes / num_kv_blocks (CUDA: "
            f"gpu_memory_utilization), or set max_model_len to at most {capacity}"
        )
    log.warning(
        "max_model_len lowered to what the KV cache holds: longer requests are refused at admission",
        model_max_model_len=max_model_len,
        max_model_len=capacity,
        kv_blocks=num_blocks,
        block_size=args.block_size,
        hint="raise kv_cache_bytes (CUDA: gpu_memory_utilization) to serve longer sequences",
    )
    return capacity


# files an older GPTQ/AWQ export puts beside a config.json that does not name its quantization: loading such weights
# as plain ones would compute garbage, so they are refused at start
_WEIGHT_FORMAT_FIELDS = ("quantization_config", "compression_config")
_WEIGHT_FORMAT_FILES = ("quantize_config.json", "quant_config.json")


def refuse_unimplemented_weights(model_dir: Path) -> None:
    """ModelLoadError for a checkpoint that quantization detection read as float but whose weights are quantized
    (a GPTQ/AWQ quantize_config.json beside a config.json without quantization_config), naming the file."""
    if not model_dir.is_dir():
        return
    import json

    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # ModelConfig.from_pretrained reports a missing or broken config.json
    found = [name for name in _WEIGHT_FORMAT_FIELDS if raw.get(name)]
    found += [name for name in _WEIGHT_FORMAT_FILES if (model_dir / name).is_file()]
    if not found:
        return
    spec = raw.get(found[0]) if found[0] in raw else {}
    scheme = spec.get("quant_method") or spec.get("format") if isinstance(spec, dict) else None
    raise ModelLoadError(
        f"{model_dir}: the checkpoint's weights are quantized or compressed ({', '.join(found)}"
        f"{f': {scheme}' if scheme else ''}), which this engine does not implement; loading them as plain weights "
        "would be wrong. Add the quantization_config to config.json (as transformers saves it), or serve the "
        "unquantized checkpoint"
    )


class StartDeadline:
    """EngineArgs.start_timeout over every step of a start: `async with deadline.step("what")` fails with
    EngineStartError, naming the step, once the start as a whole has run past it."""

    def __init__(self, args: EngineArgs) -> None:
        import time

        self.seconds = args.start_timeout
        self._end = time.monotonic() + self.seconds
        self._model = str(args.model)

    def step(self, what: str):
        import contextlib
        import time

        import anyio

        @contextlib.contextmanager
        def scope():
            try:
                with anyio.fail_after(max(0.0, self._end - time.monotonic())):
                    yield
            except TimeoutError:
                raise EngineStartError(
                    f"the engine did not start within start_timeout={self.seconds:g} s: {what} of {self._model!r} "
                    "had not finished (a model file that cannot be read to its end, a stalled device or database); "
                    "check the model folder and the audit database, or raise start_timeout"
                ) from None

        return scope()


async def prepare_within(deadline: StartDeadline, args: EngineArgs) -> EngineSetup:
    """prepare() in a worker thread under the start deadline (the thread is left behind if it never returns)."""
    import anyio

    with deadline.step("reading the model and its configuration"):
        return await anyio.to_thread.run_sync(prepare, args, abandon_on_cancel=True)


def _cuda_kv_budget(
    args: EngineArgs,
    config: ModelConfig,
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    graph_batch: int,
    quantization: QuantScheme | None,
) -> int:
    """KV-cache bytes from gpu_memory_utilization, as vLLM sizes it (gpu/kv_budget.py); a quantized base's weights
    at their packed size, plus the one projection a prefill step dequantizes at a time."""
    from loraledger.gpu import kv_budget
    from loraledger.gpu.cuda_graphs import capture_sizes
    from loraledger.gpu.ops_quant import GEMV_MAX_TOKENS
    from loraledger.gpu.packed_weight_bytes import dequantize_scratch_bytes

    # memory an earlier engine of this process freed is still held by torch's caching allocator: give it back first
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    size = torch.empty((), dtype=dtype).element_size()
    other = (
        kv_budget.lora_slots_bytes(
            config, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, element_size=size
        )
        if args.enable_lora
        else 0
    )
    if graph_batch:
        other += kv_budget.cuda_graph_bytes(config, capture_sizes(graph_batch), with_lora=args.enable_lora)
    if quantization is not None and not quantization.quantized_at_load:
        # a decode graph of more rows than the GEMV takes keeps its own dequantized copy in the graphs' memory pool
        copies = 2 if graph_batch > GEMV_MAX_TOKENS else 1
        other += copies * dequantize_scratch_bytes(config.module_shapes(), size)
    budget = kv_budget.kv_cache_budget(
        total_bytes=total,
        free_bytes=free,
        utilization=args.gpu_memory_utilization,
        weights_bytes=kv_budget.weights_bytes(model_dir, size, quantization),
        activation_peak_bytes=kv_budget.activation_peak_bytes(
            config,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            element_size=size,
        ),
        other_bytes=other,
    )
    log.info(
        "KV cache sized from gpu_memory_utilization",
        utilization=args.gpu_memory_utilization,
        kv_bytes=budget,
        total_bytes=total,
    )
    return budget


def open_store(args: EngineArgs, sources: dict | None = None):
    """The audit store, with this engine registered in it as an instance (`sources`: where its model and tokenizer
    came from, as sources.engine_sources.instance_fields gives them)."""
    if args.audit_url is None:
        log.warning("auditing is OFF (audit_url=None): outputs are not recorded")
        return None
    from loraledger.paths import default_audit_url
    from loraledger.store.audit_store import AuditStore

    url = default_audit_url() if args.audit_url == DEFAULT_AUDIT_URL else args.audit_url
    from loraledger.evidence.log_key import LogKey
    from loraledger.store.instances import this_instance
    from loraledger.version import __version__

    store = AuditStore(url, timeout=args.audit_timeout)
    store.open()
    try:
        store.log_key = LogKey.load(args.log_key_file, create=True)  # signs every finished request's receipt
        # this engine joins the database as an instance: its row on the chain, and a lease it renews while it runs
        record = this_instance(__version__, args.audit_lease_seconds)
        instance = store.register(msgspec.structs.replace(record, **(sources or {})))
    except BaseException:
        store.close()
        raise
    log.info("engine instance registered", instance_id=instance.instance_id, host=instance.host, pid=instance.pid)
    return store
