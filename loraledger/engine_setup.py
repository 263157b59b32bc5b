"""Turns EngineArgs into an EngineSetup: backend and dtype choice, tokenizer, model config, KV-cache size, audit store."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from loraledger.actors.engine_core import EngineSetup
from loraledger.engine_args import DEFAULT_AUDIT_URL, EngineArgs
from loraledger.errors import ConfigError, ModelLoadError
from loraledger.gpu.config import ModelConfig
from loraledger.logging import get_logger

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_KV_BYTES = {"cpu": 256 << 20, "cuda": 8 << 30}

log = get_logger("engine_setup")


def resolve_dtype(requested: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cpu":
        return torch.float32  # bf16/fp16 GEMMs are slow on most CPUs
    saved = (config.torch_dtype or "").replace("torch.", "")
    return torch.float16 if saved == "float16" else torch.bfloat16


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {path!r}: {exc}; the folder needs tokenizer files (tokenizer.json or the like)") from exc


def prepare(args: EngineArgs) -> EngineSetup:
    """Everything slow or fallible that must happen before the actors start (runs in a worker thread)."""
    from loraledger.gpu.backend import select_backend
    from loraledger.gpu.kv_cache import KVCache
    from loraledger.gpu.model_runner import ModelRunner
    from loraledger.gpu.weights import model_fingerprint

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {str(model_dir)!r} does not exist; pass the path of a Hugging Face checkpoint folder")
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    ops, device = select_backend(args.device)
    config = ModelConfig.from_pretrained(model_dir)
    dtype = resolve_dtype(args.dtype, config, device)
    max_model_len = args.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={config.max_position_embeddings}; "
            "lower max_model_len"
        )
    tokenizer = load_tokenizer(args.tokenizer_path)
    per_block = KVCache.bytes_per_block(config, args.block_size, dtype)
    if args.num_kv_blocks is not None:
        num_blocks = args.num_kv_blocks
    else:
        wanted = args.max_num_seqs * -(-max_model_len // args.block_size) * per_block
        budget = args.kv_cache_bytes if args.kv_cache_bytes is not None else min(wanted, _DEFAULT_KV_BYTES[device.type])
        num_blocks = max(1, budget // per_block)
    if num_blocks * args.block_size < max_model_len // 8 and num_blocks < 2:
        raise ConfigError(f"the KV cache holds only {num_blocks} block(s); raise num_kv_blocks or kv_cache_bytes")
    fingerprint = model_fingerprint(str(model_dir))
    store = open_store(args)
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
        cuda_graph_max_batch=0 if args.enforce_eager or device.type != "cuda" else min(args.max_num_seqs, 256),
    )
    log.info(
        "engine prepared",
        model=str(model_dir),
        device=str(device),
        dtype=str(dtype),
        kv_blocks=num_blocks,
        block_size=args.block_size,
        max_model_len=max_model_len,
        audit=store is not None,
    )
    return EngineSetup(
        args=args,
        model_config=config,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        num_kv_blocks=num_blocks,
        base_model_fingerprint=fingerprint,
        make_runner=make_runner,
        store=store,
        async_scheduling=args.async_scheduling if args.async_scheduling is not None else device.type == "cuda",
        max_n=args.resolved_max_n(num_blocks),
    )


def open_store(args: EngineArgs):
    if args.audit_url is None:
        log.warning("auditing is OFF (audit_url=None): outputs are not recorded")
        return None
    from loraledger.store.audit_store import AuditStore
    from loraledger.paths import default_audit_url

    url = default_audit_url() if args.audit_url == DEFAULT_AUDIT_URL else args.audit_url
    store = AuditStore(url, timeout=args.audit_timeout)
    store.open()
    return store
