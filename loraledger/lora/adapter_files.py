"""An adapter folder's two files: where they are, and reading them within bounds before anything is parsed."""

from __future__ import annotations

import contextlib
from pathlib import Path

from loraledger.errors import AdapterFormatError, AdapterNotFoundError
from loraledger.lora.adapter_errors import AdapterErrors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes


def adapter_files(folder: Path, err: AdapterErrors) -> tuple[Path, Path]:
    """The config and weights files of an adapter folder, or AdapterNotFoundError saying which is missing."""
    try:
        exists, is_dir = folder.exists(), folder.is_dir()
    except (OSError, ValueError) as exc:  # ValueError: a path with NUL
        raise err(
            AdapterNotFoundError,
            f"adapter folder {str(folder)!r} cannot be opened ({exc}); check the LoRARequest's lora_path",
        ) from exc
    if not exists:
        raise err(
            AdapterNotFoundError, f"adapter folder {str(folder)!r} does not exist; check the LoRARequest's lora_path"
        )
    if not is_dir:
        raise err(
            AdapterNotFoundError,
            f"{str(folder)!r} is not a directory; lora_path must name the "
            f"folder holding {CONFIG_FILE} and {WEIGHTS_FILE}",
        )
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise err(
            AdapterNotFoundError,
            f"{CONFIG_FILE} is missing from {str(folder)!r}; save the adapter with peft's save_pretrained()",
        )
    if not weights_path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise err(
                AdapterNotFoundError,
                f"only {WEIGHTS_FILE} is supported and the folder holds adapter_model.bin; "
                'convert it: python -c "import torch; from safetensors.torch import save_file; '
                "save_file(torch.load('adapter_model.bin'), 'adapter_model.safetensors')\"",
            )
        raise err(
            AdapterNotFoundError,
            f"{WEIGHTS_FILE} is missing from {str(folder)!r}; save the adapter with peft's save_pretrained()",
        )
    return config_path, weights_path


def read_config(path: Path, err: AdapterErrors) -> bytes:
    """The config file's bytes; one larger than MAX_CONFIG_BYTES is refused without reading the rest."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise err(AdapterNotFoundError, f"cannot read {CONFIG_FILE}: {exc}; check the folder's permissions") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise err(
            AdapterFormatError,
            f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes; it is not a PEFT adapter config, re-save the adapter",
        )
    return data


@contextlib.contextmanager
def open_weights(path: Path, err: AdapterErrors):
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise err(AdapterNotFoundError, f"cannot read {WEIGHTS_FILE}: {exc}; check the folder's permissions") from exc
    with f:
        yield f
