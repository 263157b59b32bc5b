"""PEFT's target rules: which base modules target_modules / exclude_modules / layers_to_transform select."""

from __future__ import annotations

import re

from loraledger.errors import AdapterFormatError, AdapterTargetError
from loraledger.gpu.model_config import ModelConfig
from loraledger.lora.adapter_errors import AdapterErrors
from loraledger.lora.adapter_files import CONFIG_FILE
from loraledger.lora.peft_names import candidate_modules, peft_modules, split_names


def declared_targets(config: dict, model_config: ModelConfig, err: AdapterErrors) -> set[str] | None:
    """The full module names adapter_config.json targets (None: not declared), refusing unsupported ones."""
    targets, exclude = config.get("target_modules"), config.get("exclude_modules")
    if targets is None:
        return None
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(peft_modules(model_config))  # PEFT's shorthand: every linear layer except the output layer
    valid = isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))
    valid_ex = (
        exclude is None
        or isinstance(exclude, str)
        or (isinstance(exclude, list) and all(isinstance(t, str) for t in exclude))
    )
    if not (valid and valid_ex):
        raise err(
            AdapterFormatError,
            f"{CONFIG_FILE} target_modules/exclude_modules must be a list of names or a regex string",
        )
    try:
        declared = {
            k for k in candidate_modules(model_config) if matches(targets, k) and not (exclude and matches(exclude, k))
        }
    except re.error as exc:
        raise err(
            AdapterFormatError, f"{CONFIG_FILE} target_modules/exclude_modules is not a valid regex: {exc}"
        ) from exc
    if not isinstance(targets, str):  # PEFT applies layers_to_transform to a list of targets only
        declared = {k for k in declared if in_transformed_layers(config, k, err)}
    supported = peft_modules(model_config)
    bad = sorted({k.rsplit(".", 1)[-1] for k in declared} - set(supported))
    if bad:
        raise err(
            AdapterTargetError,
            f"target_modules {targets!r} selects {', '.join(bad)}, which LoRA cannot be applied to here; "
            f"supported targets: {', '.join(supported)}. Retrain without them",
        )
    if not declared:
        raise err(
            AdapterTargetError,
            f"target_modules {targets!r} matches no module of this {model_config.architecture} base model; "
            f"supported targets: {', '.join(supported)}. Is the adapter for another base model?",
        )
    return split_names(declared)


def matches(pattern: object, key: str) -> bool:
    """PEFT's rule: a string is a regex that must match the whole name; a list entry matches by dotted suffix."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, key) is not None
    return any(key == t or key.endswith("." + t) for t in pattern)


def in_transformed_layers(config: dict, key: str, err: AdapterErrors) -> bool:
    """PEFT's layers_to_transform / layers_pattern rule for one module name (a list of target names only):
    the module's layer index, found after a layers_pattern segment (any segment when there is none),
    must be the given index or one of the given list."""
    indexes, pattern = config.get("layers_to_transform"), config.get("layers_pattern")
    if indexes is None or indexes == []:
        return True
    ok_indexes = (type(indexes) is int and indexes >= 0) or (
        isinstance(indexes, list) and all(type(i) is int and i >= 0 for i in indexes)
    )
    ok_pattern = (
        pattern is None
        or isinstance(pattern, str)
        or (isinstance(pattern, list) and all(isinstance(p, str) for p in pattern))
    )
    if not (ok_indexes and ok_pattern):
        raise err(
            AdapterFormatError,
            f"{CONFIG_FILE} has layers_to_transform={indexes!r} / layers_pattern={pattern!r}; "
            "they must be a layer index or a list of them / a name or a list of names",
        )
    if not pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        match = None
        for p in [pattern] if isinstance(pattern, str) else pattern:
            try:
                match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            except re.error as exc:
                raise err(
                    AdapterFormatError, f"{CONFIG_FILE} layers_pattern {p!r} is not a valid regex: {exc}"
                ) from exc
            if match is not None:
                break
    if match is None:
        return False
    layer = int(match["idx"])
    return layer == indexes if type(indexes) is int else layer in indexes
