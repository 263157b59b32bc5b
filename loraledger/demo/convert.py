"""A GGUF checkpoint to a Hugging Face checkpoint folder (config.json, model.safetensors, the tokenizer and its
chat template), read by transformers with the `gguf` package: the quantized weights are dequantized to float32
once, so the engine, transformers and PEFT all load the same folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraledger.errors import ModelLoadError


@dataclass
class Converted:
    """The converted checkpoint, as written and as held in memory (the trainer uses it without reading it back)."""

    model_dir: Path
    config: dict
    weights: Mapping[str, torch.Tensor]
    tokenizer: object


def convert_gguf(gguf_path: Path, out_dir: Path) -> Converted:
    """Write the checkpoint folder out_dir from the GGUF file (a Llama-architecture model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # transformers shows its own progress bar while it dequantizes
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"cannot read the GGUF file {gguf_path} with transformers: {exc}") from exc
    config = model.config.to_dict()
    if config.get("model_type") != "llama":
        raise ModelLoadError(f"{gguf_path.name} is a {config.get('model_type')!r} model; the demo converts Llama ones")
    # the folder holds plain float32 weights: nothing of the GGUF loading path belongs in its config
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = "float32"
    tied = bool(config.get("tie_word_embeddings"))
    weights = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokenizer.save_pretrained(str(partial))
    (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(dict(weights), str(partial / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.replace(out_dir)
    return Converted(model_dir=out_dir, config=config, weights=weights, tokenizer=tokenizer)


def load_converted(model_dir: Path) -> Converted:
    """A folder convert_gguf wrote, read back (for training adapters on a model converted earlier)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    return Converted(model_dir, config, weights, AutoTokenizer.from_pretrained(str(model_dir)))
