"""The files a model, a tokenizer or an adapter needs from a repo, and whether a local folder holds them all.

Only what the engine reads is fetched: the small files at the repo's top level (configs, tokenizer
files, chat templates) and the safetensors weights (a sharded model's shards as its index lists
them). Pickled weights (*.bin, *.pt), other frameworks' files and subfolders are never downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

MODEL, TOKENIZER, ADAPTER = "model", "tokenizer", "adapter"
KINDS = (MODEL, TOKENIZER, ADAPTER)

SMALL_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MODEL_CONFIG = "config.json"
WEIGHTS_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def small_files(kind: str, names: Iterable[str]) -> list[str]:
    """The first files to fetch: every small top-level file, and an adapter's weights (one file, bounded by the loader)."""
    top = sorted(n for n in names if "/" not in n)
    small = [n for n in top if n.endswith(SMALL_SUFFIXES)]
    if kind == ADAPTER and ADAPTER_FILES[1] in top:
        small.append(ADAPTER_FILES[1])
    return small


def model_weights(names: Iterable[str], index: dict | None) -> list[str]:
    """A model's safetensors files: the shards its index names, else model.safetensors, else every top-level one."""
    top = sorted(n for n in names if "/" not in n)
    if index is not None:
        return sorted({str(f) for f in (index.get("weight_map") or {}).values()})
    if SINGLE_WEIGHTS in top:
        return [SINGLE_WEIGHTS]
    return [n for n in top if n.endswith(".safetensors")]


def read_index(folder: Path) -> dict | None:
    """The model's safetensors index (None when it has none); an unreadable one is an empty index."""
    path = folder / WEIGHTS_INDEX
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def required(kind: str, folder: Path) -> list[str]:
    """The files a `kind` needs in `folder` (as far as the folder itself tells: a model's index names its shards)."""
    if kind == ADAPTER:
        return list(ADAPTER_FILES)
    if kind == TOKENIZER:
        present = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
        return present or [TOKENIZER_FILES[0]]
    index = read_index(folder)
    present = [p.name for p in folder.glob("*.safetensors")] if folder.is_dir() else []
    weights = model_weights(present, index) if index is not None or present else [SINGLE_WEIGHTS]
    return [MODEL_CONFIG, *(([WEIGHTS_INDEX] if index is not None else []) + weights)]


def missing(kind: str, folder: Path) -> list[str]:
    """The required files `folder` lacks (a dangling link to a blob that never finished counts as lacking)."""
    return [n for n in required(kind, folder) if not (folder / n).is_file()]
