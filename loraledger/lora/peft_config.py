"""adapter_config.json as PEFT writes it: parsed, the options we serve checked, r / lora_alpha and their patterns."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from loraledger.errors import AdapterFormatError, AdapterRankError, AdapterUnsupportedError
from loraledger.lora.adapter_errors import AdapterErrors
from loraledger.lora.adapter_files import CONFIG_FILE
from loraledger.lora.peft_names import FUSED_OF, module_name


def parse_config(data: bytes, err: AdapterErrors) -> dict:
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise err(AdapterFormatError, f"{CONFIG_FILE} is not valid JSON ({exc}); re-save the adapter") from exc
    if not isinstance(config, dict):
        raise err(
            AdapterFormatError,
            f"{CONFIG_FILE} must hold a JSON object, got {type(config).__name__}; re-save the adapter",
        )
    return config


def check_supported(config: dict, err: AdapterErrors) -> None:
    """Refuse the PEFT options whose effect the engine does not apply (DoRA, trained biases, extra modules...)."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise err(
            AdapterUnsupportedError,
            f"peft_type {peft_type!r} is not supported yet; only LoRA adapters (peft_type 'LORA') can be served",
        )
    problems = []
    if config.get("use_dora"):
        problems.append("use_dora=true (DoRA)")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save={config['modules_to_save']!r} (fully trained extra modules)")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config['bias']!r} (trained biases)")
    if config.get("lora_bias"):
        problems.append("lora_bias=true (a bias on lora_B)")
    for key in (
        "fan_in_fan_out",
        "layer_replication",
        "target_parameters",
        "trainable_token_indices",
        "alora_invocation_tokens",
    ):
        if config.get(key):
            problems.append(f"{key}={config[key]!r}")
    if problems:
        raise err(
            AdapterUnsupportedError,
            f"the adapter uses {', '.join(problems)}, which is not supported yet; "
            "retrain or re-export it as a plain LoRA adapter without these options",
        )


def rank_and_alpha(config: dict, err: AdapterErrors) -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora) of the config."""
    # missing values take PEFT's LoraConfig defaults, as PEFT itself would when loading
    rank, alpha, rslora = config.get("r", 8), config.get("lora_alpha", 8), config.get("use_rslora", False)
    if type(rank) is not int or rank < 1:
        raise err(AdapterFormatError, f"{CONFIG_FILE} has r={rank!r}; it must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise err(AdapterFormatError, f"{CONFIG_FILE} has lora_alpha={alpha!r}; it must be a finite number")
    if not isinstance(rslora, bool):
        raise err(AdapterFormatError, f"{CONFIG_FILE} has use_rslora={rslora!r}; it must be true or false")
    return rank, float(alpha), rslora


def scale_of(rank: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's scale of a LoRA delta: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def rank_error(err: AdapterErrors, what: str, rank: int, max_lora_rank: int) -> Exception:
    allowed = 1 << (rank - 1).bit_length()  # EngineArgs accepts powers of two only
    return err(
        AdapterRankError,
        f"{what}, above max_lora_rank={max_lora_rank}; raise max_lora_rank to at least {rank} "
        f"(max_lora_rank={allowed}, it must be a power of two)",
    )


@dataclass(frozen=True)
class Patterns:
    """PEFT's rank_pattern and alpha_pattern: per-module r and lora_alpha, matched by peft's rule (the first key,
    in the config's order, that matches the end of the module's name after a dot, as a regex).

    fused: the base model fuses q/k/v and gate/up (Phi-3), so its modules, the names PEFT matched, are the fused
    ones (qkv_proj, gate_up_proj); the engine holds their parts, and each part takes its fused module's entry."""

    ranks: dict
    alphas: dict
    fused: bool = False

    @staticmethod
    def _key(pattern: dict, name: str) -> str | None:
        return next((k for k in pattern if re.match(rf"(.*\.)?({k})$", name)), None)

    def _name(self, key: tuple[int, str]) -> str:
        layer, module = key
        return module_name((layer, FUSED_OF.get(module, module) if self.fused else module))

    def rank_of(self, default: int):
        def rank(key: tuple[int, str]) -> int:
            found = self._key(self.ranks, self._name(key))
            return default if found is None else self.ranks[found]

        return rank

    def alpha_of(self, default: float):
        def alpha(key: tuple[int, str]) -> float:
            found = self._key(self.alphas, self._name(key))
            return default if found is None else float(self.alphas[found])

        return alpha


def patterns(config: dict, err: AdapterErrors, *, fused: bool = False) -> Patterns:
    """The config's rank_pattern and alpha_pattern, checked (values and regex keys); fused: see Patterns."""
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not isinstance(ranks, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 1 for k, v in ranks.items()
    ):
        raise err(
            AdapterFormatError,
            f"{CONFIG_FILE} rank_pattern must map module names to positive integer ranks, got {ranks!r}",
        )
    if not isinstance(alphas, dict) or not all(
        isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        for k, v in alphas.items()
    ):
        raise err(
            AdapterFormatError, f"{CONFIG_FILE} alpha_pattern must map module names to finite numbers, got {alphas!r}"
        )
    for k in (*ranks, *alphas):
        try:
            re.compile(k)
        except re.error as exc:
            raise err(
                AdapterFormatError, f"{CONFIG_FILE} rank_pattern/alpha_pattern key {k!r} is not a valid regex: {exc}"
            ) from exc
    return Patterns(ranks, alphas, fused)
