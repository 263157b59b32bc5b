"""What an engine reads from where: its model and tokenizer (resolved once, at start) and the Hub settings of each."""

from __future__ import annotations

from typing import Any

from loraledger.sources.fileset import MODEL, TOKENIZER
from loraledger.sources.hub_settings import HubSettings
from loraledger.sources.source import Source, resolve


def model_settings(args) -> HubSettings:
    """The Hub settings a model or tokenizer download runs under (EngineArgs: download_*)."""
    return HubSettings.from_env(
        timeout=args.download_timeout, max_bytes=args.max_download_bytes, cache_dir=args.download_dir
    )


def adapter_settings(args) -> HubSettings:
    """The Hub settings an adapter download runs under (EngineArgs: lora_download_timeout, max_lora_download_bytes)."""
    return HubSettings.from_env(
        timeout=args.lora_download_timeout, max_bytes=args.max_lora_download_bytes, cache_dir=args.download_dir
    )


def resolve_model(args) -> tuple[Source, Source | None]:
    """The model's Source and the tokenizer's (None with skip_tokenizer_init; the model's own when it is the same
    name at the same revision, so both are read from one commit). Blocks: run it off the event loop."""
    model = resolve(str(args.model), revision=args.revision, kind=MODEL, settings=model_settings(args))
    if args.skip_tokenizer_init:
        return model, None
    revision = args.tokenizer_revision_resolved
    if args.tokenizer_path == str(args.model) and revision == args.revision:
        return model, model
    tokenizer = resolve(args.tokenizer_path, revision=revision, kind=TOKENIZER, settings=model_settings(args))
    return model, tokenizer


def instance_fields(model: Source, tokenizer: Source | None) -> dict[str, Any]:
    """The `instances` columns that say where the engine's model and tokenizer came from."""
    out: dict[str, Any] = {}
    for what, source in (("model", model), ("tokenizer", tokenizer)):
        out[what] = None if source is None else source.name
        out[f"{what}_repo_id"] = None if source is None else source.repo_id
        out[f"{what}_revision"] = None if source is None else source.revision
        out[f"{what}_commit_sha"] = None if source is None else source.commit
    return out


def quantization_fields(scheme, source_fingerprint: str | None = None) -> dict[str, Any]:
    """The `instances` columns that say how the served base model's weights are quantized (all None: float);
    source_fingerprint: the float checkpoint's fingerprint when the engine quantized it at load."""
    return {
        "quant_source_fingerprint": source_fingerprint,
        "quantization": None if scheme is None else scheme.describe(),
        "quant_method": None if scheme is None else scheme.method,
        "quant_bits": None if scheme is None else scheme.bits,
        "quant_group_size": None if scheme is None else scheme.group_size,
    }


def adapter_fields(source: Source | None, prefix: str = "") -> dict[str, Any]:
    """An adapter's source as the `adapters` columns (prefix "") or the `requests` columns (prefix "adapter_")."""
    return {
        f"{prefix}repo_id": None if source is None else source.repo_id,
        f"{prefix}revision": None if source is None else source.revision,
        f"{prefix}commit_sha": None if source is None else source.commit,
    }


def tokenizer_lora(lora, ckpt):
    """The LoRARequest a TokenizerGroup reads an adapter's own tokenizer files through: for an adapter read from a
    Hub snapshot, the snapshot's folder (so a new commit is a new tokenizer too); otherwise the request's own."""
    source = getattr(ckpt, "source", None)
    if lora is None or source is None or source.folder == lora.lora_path:
        return lora
    from loraledger.lora.request import LoRARequest

    return LoRARequest(lora.lora_name, lora.lora_int_id, source.folder)
