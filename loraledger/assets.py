"""Demo and test assets made offline: a small BPE tokenizer, random Llama/Qwen2 checkpoints, random PEFT adapters.

Nothing here downloads anything. Checkpoints use Hugging Face key names and config.json, adapters
use PEFT's folder format, so transformers and peft load them like any published model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraledger.errors import ConfigError
from loraledger.gpu.model_config import LORA_TARGETS, ModelConfig

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, Llama's order for the first three

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_CORPUS = """\
The engine keeps one base model in memory and serves many small adapters on top of it.
Each request names the adapter it wants, or none at all, and the scheduler batches them together.
A ledger records every answer, the adapter that produced it, and the exact bytes of that adapter.
Auditors can later ask which model said what, to whom, and when, and the record cannot be edited.
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
Once upon a time there was a small village at the edge of a great forest, where the river bent twice.
The people of the village kept bees, grew apples and barley, and traded honey for salt and iron.
Every spring the river rose, and every autumn the children counted the geese flying south.
In the library there were books about stars, machines, numbers, oceans, and the history of kings.
A good question is often worth more than a quick answer, and a careful answer is worth waiting for.
Weather today: cloudy in the morning, bright in the afternoon, with a light wind from the west.
Please write a short poem about the sea. Please summarize the meeting notes in three sentences.
What is the capital of France? Paris is the capital of France, and it stands on the river Seine.
How many legs does a spider have? A spider has eight legs, while an insect has six legs.
The recipe needs two cups of flour, one egg, a spoon of sugar, a pinch of salt, and warm milk.
Mix the dry ingredients first, then add the milk slowly, and stir until the batter is smooth.
The train leaves at seven in the evening and arrives at the coast a little after midnight.
Numbers: one two three four five six seven eight nine ten eleven twelve hundred thousand.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June.
Translate the sentence into French. Explain the idea to a child. List three reasons and one example.
The model reads tokens, attends to the context, and predicts the next token one step at a time.
Memory is divided into blocks, and each sequence owns a table that maps its positions to blocks.
When memory runs short, the newest sequence is paused and resumed later, so that nothing starves.
"""


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE on an embedded English corpus and save it for AutoTokenizer.

    Special tokens <unk> <s> </s> <pad> (ids 0..3); the post-processor prepends <s> like Llama's.
    Returns the number of tokens actually in the vocabulary (at most `vocab_size`).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260 + len(SPECIAL_TOKENS):
        raise ConfigError(
            f"vocab_size must be >= {260 + len(SPECIAL_TOKENS)} (256 bytes, the special tokens and a few merges), "
            f"got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return tokenizer.get_vocab_size()


def build_random_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype | str = torch.float32,
    tie_word_embeddings: bool | None = None,
    embed_std: float = 0.02,
    logit_std: float = 4.0,
) -> Path:
    """Write config.json and model.safetensors (HF key names) of a randomly initialised decoder.

    Linear weights are normal(0, 1/sqrt(fan_in)) so every layer's output is O(1) and outweighs the
    small embeddings (normal(0, embed_std)) in the residual stream: greedy generation then follows the
    context instead of repeating the current token (which tied embeddings otherwise favour). The final
    norm's weight scales the logits to a spread of about `logit_std`, so that greedy choices are not
    near-ties that rounding could flip. Layer norms are one. Returns the folder.
    """
    if arch not in _ARCHITECTURES:
        raise ConfigError(f"arch must be one of {sorted(_ARCHITECTURES)}, got {arch!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ConfigError(
            f"hidden_size ({hidden_size}) must divide by num_heads ({num_heads}), "
            f"and num_heads by num_kv_heads ({num_kv_heads})"
        )
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tied = (arch == "qwen2") if tie_word_embeddings is None else tie_word_embeddings
    config = _hf_config(
        arch,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tied,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        initializer_range=embed_std,
    )
    config.architectures = [_ARCHITECTURES[arch]]
    mc = ModelConfig.from_dict(config.to_dict())
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch_dtype)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, hidden_size, std=embed_std)}
    shapes = mc.module_shapes()
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for module, (in_f, out_f) in shapes.items():
            kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            tensors[f"{p}{kind}.{module}.weight"] = normal(out_f, in_f, std=in_f**-0.5)
            if mc.attention_bias and module in ("q_proj", "k_proj", "v_proj"):
                tensors[f"{p}{kind}.{module}.bias"] = normal(out_f, std=0.1)
        tensors[f"{p}input_layernorm.weight"] = torch.ones(hidden_size, dtype=torch_dtype)
        tensors[f"{p}post_attention_layernorm.weight"] = torch.ones(hidden_size, dtype=torch_dtype)
    # logits = lm_head . (norm(h) * w): with lm_head entries ~ embed_std, w sets their spread
    final_norm = logit_std / (embed_std * hidden_size**0.5)
    tensors["model.norm.weight"] = torch.full((hidden_size,), final_norm, dtype=torch_dtype)
    if not tied:
        tensors["lm_head.weight"] = normal(vocab_size, hidden_size, std=embed_std)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.dtype = torch_dtype
    config.to_json_file(str(out / "config.json"))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_random_adapter(
    out_dir: str | Path,
    model_dir: str | Path,
    *,
    rank: int,
    alpha: float,
    target_modules: Iterable[str],
    seed: int,
    use_rslora: bool = False,
    b_std: float = 0.05,
) -> Path:
    """Write a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) for `model_dir`.

    A is uniform(+-1/sqrt(in)) like PEFT's init; B is normal(0, b_std), non-zero so that the adapter
    changes the model's output. Tensors are fp32 with PEFT's key names. Returns the folder.
    """
    targets = sorted(set(target_modules), key=LORA_TARGETS.index) if set(target_modules) <= set(LORA_TARGETS) else None
    if not targets:
        raise ConfigError(
            f"target_modules must be a non-empty subset of {list(LORA_TARGETS)}, got {list(target_modules)}"
        )
    if rank < 1:
        raise ConfigError(f"rank must be >= 1, got {rank}")
    mc = ModelConfig.from_pretrained(model_dir)
    shapes = mc.module_shapes()
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(mc.num_hidden_layers):
        for module in targets:
            in_f, out_f = shapes[module]
            kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{kind}.{module}"
            bound = in_f**-0.5
            tensors[f"{key}.lora_A.weight"] = (torch.rand(rank, in_f, generator=gen) * 2 - 1) * bound
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * b_std
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def _hf_config(arch: str, **kwargs: object):
    """The transformers config class of `arch` (config classes only: no model code is imported)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    return cls(**kwargs)
