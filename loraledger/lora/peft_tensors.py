"""An adapter's tensors by PEFT's naming: grouped into (layer, module) A/B pairs, checked, made fp32 weights."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loraledger.errors import AdapterFormatError, AdapterShapeError, AdapterTargetError, AdapterUnsupportedError
from loraledger.gpu.model_config import LORA_TARGETS, ModelConfig
from loraledger.lora.adapter_errors import AdapterErrors
from loraledger.lora.adapter_files import WEIGHTS_FILE
from loraledger.lora.peft_config import rank_error
from loraledger.lora.peft_names import BLOCK_OF, FUSED_SPLITS, TENSOR_NAME, module_name
from loraledger.lora.safetensors_header import DTYPES, RawTensor, check_dtype_and_size, to_fp32
from loraledger.lora.slot_stacks import SlotStacks

Pairs = dict[tuple[int, str], dict[str, RawTensor]]  # (layer, module) -> {"lora_A": tensor, "lora_B": tensor}


def group_tensors(raw: list[RawTensor], err: AdapterErrors, model_config: ModelConfig | None = None) -> Pairs:
    """(layer, module) -> {"lora_A": tensor, "lora_B": tensor} from the PEFT tensor names; a fused module's pair
    (Phi-3's qkv_proj, gate_up_proj) becomes its parts' pairs when `model_config` is given."""
    if not raw:
        raise err(AdapterFormatError, f"{WEIGHTS_FILE} holds no tensors; re-save the adapter")
    _refuse_non_lora(raw, err)
    pairs: Pairs = {}
    adapter_names = set()
    for t in raw:
        m = TENSOR_NAME.fullmatch(t.name)
        if m is None:
            cls = AdapterUnsupportedError if t.name.endswith(".bias") else AdapterFormatError
            raise err(
                cls,
                f"tensor name {t.name!r} is not a supported PEFT LoRA weight "
                "(expected base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_A|lora_B.weight)",
            )
        module = m["module"]
        if m["block"] != BLOCK_OF[module]:
            raise err(
                AdapterFormatError, f"tensor {t.name!r}: {module} belongs under {BLOCK_OF[module]}, not {m['block']}"
            )
        adapter_names.add(m["adapter"])
        slot = pairs.setdefault((int(m["layer"]), module), {})
        if m["ab"] in slot:
            raise err(
                AdapterFormatError,
                f"{WEIGHTS_FILE} holds two {m['ab']} tensors for layer {m['layer']} {module}; "
                "save a single adapter per folder",
            )
        slot[m["ab"]] = t
    if len(adapter_names) > 1:
        raise err(
            AdapterFormatError,
            f"{WEIGHTS_FILE} mixes adapter names {sorted(map(str, adapter_names))}; save one adapter per folder",
        )
    return pairs if model_config is None else _split_fused(pairs, model_config, err)


def _split_fused(pairs: Pairs, model_config: ModelConfig, err: AdapterErrors) -> Pairs:
    """Each fused module's A/B pair as its parts' pairs: A shared, B's rows split (views of the same bytes)."""
    fused = sorted({module for _, module in pairs if module in FUSED_SPLITS})
    if fused and not model_config.fused_projections:
        raise err(
            AdapterTargetError,
            f"the adapter targets {', '.join(fused)}, fused modules of Phi-3 checkpoints; this "
            f"{model_config.architecture} base model has {', '.join(p for f in fused for p in FUSED_SPLITS[f])} "
            "apart. Is the adapter for another base model?",
        )
    if not fused:
        return pairs
    shapes = model_config.module_shapes()
    out: Pairs = {}
    for (layer, module), slot in pairs.items():
        if module not in FUSED_SPLITS:
            out[(layer, module)] = slot
            continue
        parts = FUSED_SPLITS[module]
        b = slot.get("lora_B")
        rows = [shapes[p][1] for p in parts]
        if b is None or len(b.shape) != 2 or b.shape[0] != sum(rows) or b.dtype not in DTYPES:
            shape = None if b is None else list(b.shape)
            raise err(
                AdapterShapeError,
                f"layer {layer} {module}: lora_B is {shape}, the base model needs [{sum(rows)}, r]; "
                "the adapter was probably trained for a different base model",
            )
        row_bytes = b.shape[1] * DTYPES[b.dtype][1]
        start = 0
        for part, n in zip(parts, rows):
            lo, hi = start * row_bytes, (start + n) * row_bytes
            part_b = RawTensor(
                b.name, b.dtype, (n, b.shape[1]), b.begin + lo, b.begin + hi, None if b.data is None else b.data[lo:hi]
            )
            out[(layer, part)] = {**slot, "lora_B": part_b}
            start += n
    return out


def _refuse_non_lora(raw: list[RawTensor], err: AdapterErrors) -> None:
    """DoRA magnitudes, LoRA tensors of modules we cannot apply LoRA to, and whole (non-LoRA) weights."""
    unsupported, full_weights = set(), []
    for t in raw:
        parts = t.name.split(".")
        lora_at = next((i for i, p in enumerate(parts) if p.startswith("lora_")), None)
        if lora_at is None:
            full_weights.append(t.name)
        elif parts[lora_at] == "lora_magnitude_vector":
            raise err(
                AdapterUnsupportedError,
                f"tensor {t.name!r} is a DoRA magnitude vector; DoRA is not supported yet, use a plain LoRA adapter",
            )
        elif lora_at == 0 or parts[lora_at - 1] not in (*LORA_TARGETS, *FUSED_SPLITS):
            unsupported.add(".".join(parts[:lora_at]) or t.name)
    if unsupported:
        raise err(
            AdapterTargetError,
            f"the adapter has LoRA tensors for {', '.join(sorted(unsupported))}, which LoRA cannot be "
            f"applied to here; supported targets: {', '.join(LORA_TARGETS)}. Retrain without them",
        )
    if full_weights:
        # PEFT writes whole weights for modules_to_save and for saved embedding layers
        raise err(
            AdapterUnsupportedError,
            f"the adapter holds full (non-LoRA) weights such as {full_weights[0]!r}; replacing base "
            "weights is not supported yet, export a plain LoRA adapter (no modules_to_save, "
            "save_embedding_layers=False)",
        )


def _some(names: list[str], shown: int = 3) -> str:
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_tensors(
    pairs: Pairs,
    rank_of,  # (layer, module) -> the rank adapter_config.json gives it (r, or its rank_pattern entry)
    declared: set[str] | None,
    model_config: ModelConfig,
    max_lora_rank: int,
    err: AdapterErrors,
) -> None:
    """Every tensor's dtype, shape and byte length against the base model, the config and max_lora_rank.

    Works on the header's entries alone: passing it bounds the bytes the tensors hold by what the
    base model allows, before they are read."""
    shapes = model_config.module_shapes()
    n_layers = model_config.num_hidden_layers

    def bad(message: str) -> Exception:
        return err(AdapterShapeError, message + "; the adapter was probably trained for a different base model")

    for (layer, module), slot in pairs.items():
        if layer >= n_layers:
            raise bad(f"the adapter has tensors for layer {layer}, the base model has {n_layers} layers")
        for ab in ("lora_A", "lora_B"):
            if ab not in slot:
                raise err(
                    AdapterShapeError,
                    f"layer {layer} {module} has no {ab} tensor (a LoRA needs both A and B); "
                    "the file is incomplete, re-save the adapter",
                )
            if len(slot[ab].shape) != 2:
                raise bad(f"{slot[ab].name} has shape {list(slot[ab].shape)}, a LoRA weight is 2-D")
        a_rank, b_rank = slot["lora_A"].shape[0], slot["lora_B"].shape[1]
        if max(a_rank, b_rank) > max_lora_rank:
            raise rank_error(
                err, f"layer {layer} {module} has rank {max(a_rank, b_rank)}", max(a_rank, b_rank), max_lora_rank
            )
        if a_rank != b_rank:
            raise bad(f"layer {layer} {module}: lora_A has rank {a_rank} but lora_B has rank {b_rank}")
        rank = rank_of((layer, module))
        if a_rank != rank:
            raise bad(
                f"layer {layer} {module} has rank {a_rank} but adapter_config.json gives it r={rank} (r or rank_pattern)"
            )
        in_f, out_f = shapes[module]
        got_a, got_b = slot["lora_A"].shape, slot["lora_B"].shape
        if got_a[1] != in_f or got_b[0] != out_f:
            raise bad(
                f"layer {layer} {module}: lora_A is {list(got_a)} and lora_B is {list(got_b)}, "
                f"the base model needs [{rank}, {in_f}] and [{out_f}, {rank}]"
            )

    if declared is not None:
        have = {module_name(key) for key in pairs}
        if extra := sorted(have - declared):
            raise err(
                AdapterFormatError,
                f"the weights file has tensors for {_some(extra)}, which adapter_config.json "
                "target_modules does not declare; the files disagree, re-save the adapter",
            )
        if missing := sorted(declared - have):
            raise err(
                AdapterShapeError,
                f"adapter_config.json targets {_some(missing)} but the weights file has no "
                "tensors for them; the file is incomplete, re-save the adapter",
            )
    for slot in pairs.values():
        for t in slot.values():
            check_dtype_and_size(t, t.end - t.begin, err)


def build_weights(pairs: Pairs, err: AdapterErrors) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) fp32 tensors per (layer, module), in layer then LORA_TARGETS order (checked by check_tensors)."""
    order = {m: i for i, m in enumerate(LORA_TARGETS)}
    return {
        key: (to_fp32(pairs[key]["lora_A"], err), to_fp32(pairs[key]["lora_B"], err))
        for key in sorted(pairs, key=lambda k: (k[0], order[k[1]]))
    }


def check_finite(
    pairs: Pairs,
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    stacks: SlotStacks,
    err: AdapterErrors,
) -> None:
    """Refuse NaN or infinite weights: they would write garbage for every request on the adapter.

    Checked on the few slot-ready stacks (one op each, instead of two per tensor: a load is on the
    critical path of adapter churn), and B's largest magnitude times the scale in fp32 (what a slot
    will hold); only when one fails are the tensors searched for the culprit.
    """
    finite = all(bool(torch.isfinite(t).all()) for pair in stacks.groups.values() for t in pair)
    if finite and all(
        bool(torch.isfinite(b.abs().amax() * stacks.largest_scale(group))) for group, (_, b) in stacks.groups.items()
    ):
        return
    for key, (a, b) in weights.items():
        for raw, tensor in ((pairs[key]["lora_A"], a), (pairs[key]["lora_B"], b)):
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise err(
                    AdapterFormatError,
                    f"tensor {raw.name!r} holds {bad} NaN or infinite value(s) (as fp32); the adapter "
                    "is broken (diverged training or a bad conversion), re-train or re-export it",
                )
    raise err(
        AdapterFormatError,
        "lora_B times the adapter's scale (lora_alpha / r) overflows fp32; "
        "the adapter is broken, re-train or re-export it",
    )
