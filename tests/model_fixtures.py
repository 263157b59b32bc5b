"""Shared pytest fixtures: tiny random Llama and Qwen2 checkpoints with PEFT adapters, and HF reference helpers.

Loaded as a plugin by tests/conftest.py. Everything is built once per test session under
tmp_path_factory, with transformers and peft themselves (no network, no hub), in a few seconds.

Fixtures (session scope), each a ``TinyModel`` with ``.model_dir`` (Path: config.json,
model.safetensors and the tokenizer files, so ``AutoTokenizer.from_pretrained(model_dir)`` and
``EngineArgs(model=str(model_dir))`` both work), ``.adapters`` (dict name -> adapter folder Path)
and ``.config`` (our ModelConfig):

- ``tiny_llama``: LlamaForCausalLM, hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA),
  head_dim 16, untied lm_head, vocab 512, max_position_embeddings 256.
- ``tiny_qwen2``: Qwen2ForCausalLM, same sizes, q/k/v biases, tied embeddings.
- ``tiny_gemma2`` / ``tiny_gemma3``: Gemma2ForCausalLM / Gemma3ForCausalLM from gemma-2-2b's and
  gemma-3-1b's config.json with the sizes shrunk: (1 + w) norms (random w), sandwich norms, scaled
  embedding, GELU-tanh MLP, a sliding-window layer and a global one (Gemma 3: each with its rope base),
  query_pre_attn_scalar apart from head_dim, soft-capping (Gemma 2) at caps low enough to bind here.
- ``tiny_qwen3``: Qwen3ForCausalLM, Qwen3-0.6B's config.json with the sizes shrunk: per-head q/k
  RMSNorm (random weights), head_dim 32 (not hidden / heads, as in the real model), tied embeddings.

Both carry the same three adapters (made with ``get_peft_model(..., init_lora_weights=False)``,
so B is non-zero and each adapter visibly changes greedy output):

- ``"qv_r4"``: rank 4, alpha 8, q_proj + v_proj;
- ``"all_r8"``: rank 8, alpha 16, all seven linear layers;
- ``"ogd_r16_rslora"``: rank 16, alpha 16, o_proj + gate_proj + down_proj, use_rslora.

Reference helpers (plain functions; import them from ``tests.model_fixtures``):

- ``hf_reference_generate(model_dir, adapters, prompts_token_ids, adapter_per_prompt,
  max_new_tokens, mixed=True) -> HFReference``: greedy generation with transformers + PEFT in
  fp32. ``adapters`` maps names to folders; ``adapter_per_prompt[i]`` is an adapter name or
  ``None`` / ``"__base__"`` for the base model. With ``mixed=True`` all prompts run in one
  left-padded ``generate(..., adapter_names=[...])`` call (PEFT's mixed-batch inference),
  otherwise one call per prompt. EOS does not stop generation: exactly ``max_new_tokens`` tokens
  come back per prompt. ``HFReference.token_ids[i]`` is the list of generated ids and
  ``HFReference.logits[i]`` the raw fp32 logits [max_new_tokens, V] that chose them.
- ``hf_greedy_choices(model_dir, adapters, prompts_token_ids, adapter_per_prompt, generated)``: the
  greedy check at the cost of one forward per prompt (no generate loop): transformers + PEFT's fp32
  argmax at each step of ``generated[i]`` given the tokens before it; equal to ``generated[i]``
  exactly when that is transformers' greedy output. For long outputs of a real model.
- ``hf_reference_logits(model_dir, adapter_path, token_ids) -> Tensor [len, V]``: fp32 logits of
  one full forward over ``token_ids`` (``adapter_path`` None for the base model).

Chat: ``tiny_llama_chat`` is ``tiny_llama`` (same weights and adapters) in a folder of its own whose
tokenizer has ``CHAT_TEMPLATE``; ``with_chat_template(src, dest, template)`` makes such a copy.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from loraledger.assets import build_tokenizer
from loraledger.gpu.model_config import ModelConfig

BASE = "__base__"
TINY_VOCAB = 512

# Qwen3-0.6B's config.json as published, less its sizes (build_tiny_model shrinks those)
QWEN3_CONFIG = dict(
    attention_bias=False,
    attention_dropout=0.0,
    hidden_act="silu",
    max_window_layers=28,
    rms_norm_eps=1e-6,
    rope_scaling=None,
    rope_theta=1_000_000,
    sliding_window=None,
    tie_word_embeddings=True,
    use_sliding_window=False,
)

# gemma-2-2b's and gemma-3-1b's config.json as published, less their sizes; the soft caps (50 and 30 in
# gemma-2) are lowered to where the tiny model's scores and logits reach them, so that capping is tested
GEMMA2_CONFIG = dict(
    attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0,
    hidden_activation="gelu_pytorch_tanh",
    query_pre_attn_scalar=24,
    rms_norm_eps=1e-6,
    sliding_window=6,
    tie_word_embeddings=True,
    head_dim=32,
)
GEMMA3_CONFIG = dict(
    hidden_activation="gelu_pytorch_tanh",
    query_pre_attn_scalar=24,
    rms_norm_eps=1e-6,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention"],
    tie_word_embeddings=True,
    head_dim=32,
)

# Phi-3-mini-4k-instruct's config.json as published, less its sizes
PHI3_CONFIG = dict(
    hidden_act="silu",
    original_max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_scaling=None,
    rope_theta=10000.0,
    sliding_window=8,
    tie_word_embeddings=False,
)

# Phi-3's checkpoints hold q/k/v and gate/up fused, so its adapters target the fused modules
PHI3_TARGETS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}

# name -> (rank, alpha, target modules, use_rslora)
TINY_ADAPTERS: dict[str, tuple[int, int, tuple[str, ...], bool]] = {
    "qv_r4": (4, 8, ("q_proj", "v_proj"), False),
    "all_r8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "ogd_r16_rslora": (16, 16, ("o_proj", "gate_proj", "down_proj"), True),
}


@dataclass(frozen=True)
class TinyModel:
    arch: str
    model_dir: Path
    adapters: dict[str, Path] = field(default_factory=dict)
    config: ModelConfig | None = None


@dataclass
class HFReference:
    token_ids: list[list[int]]
    logits: list[torch.Tensor]  # per prompt [max_new_tokens, V] fp32, raw


def build_tiny_model(root: Path, arch: str, seed: int) -> TinyModel:
    """Make a tiny checkpoint with transformers and its adapters with peft, under `root`."""
    from peft import LoraConfig, get_peft_model
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    model_dir = root / f"tiny-{arch}"
    vocab = build_tokenizer(model_dir, vocab_size=TINY_VOCAB)
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        initializer_range=0.1,  # larger than HF's 0.02 so that greedy output varies from token to token
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
        with torch.no_grad():  # HF zero-initialises biases; random ones exercise the bias path
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{**QWEN3_CONFIG, **common, "head_dim": 32}))
        with torch.no_grad():  # HF initialises the q/k norms to ones; random ones exercise them
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**{**common, **PHI3_CONFIG}))
    elif arch in ("gemma2", "gemma3"):
        if arch == "gemma2":
            model = Gemma2ForCausalLM(Gemma2Config(**{**common, **GEMMA2_CONFIG}))
        else:
            model = Gemma3ForCausalLM(Gemma3TextConfig(**{**common, **GEMMA3_CONFIG}))
        with (
            torch.no_grad()
        ):  # HF initialises Gemma's norm weights to zero, i.e. (1 + w) = 1: random ones test the offset
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    model.save_pretrained(model_dir, safe_serialization=True)
    adapters = {}
    for n, (name, (rank, alpha, targets, rslora)) in enumerate(TINY_ADAPTERS.items()):
        torch.manual_seed(seed * 100 + n + 1)
        lora = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=sorted({PHI3_TARGETS.get(t, t) for t in targets}) if arch == "phi3" else list(targets),
            use_rslora=rslora,
            init_lora_weights=False,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(copy.deepcopy(model), lora)
        adapters[name] = root / f"tiny-{arch}-{name}"
        peft_model.save_pretrained(adapters[name])
    return TinyModel(arch=arch, model_dir=model_dir, adapters=adapters, config=ModelConfig.from_pretrained(model_dir))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


# a small chat template in the usual shape: BOS written by the template, one header per role, EOS after each turn
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def with_chat_template(src: Path, dest: Path, template: str = CHAT_TEMPLATE) -> Path:
    """A copy of the checkpoint folder `src` at `dest` whose tokenizer has `template` as its chat template."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(src, dest)
    tokenizer = AutoTokenizer.from_pretrained(dest)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(dest)
    return dest


@pytest.fixture(scope="session")
def tiny_llama_chat(tiny_llama: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    model_dir = with_chat_template(tiny_llama.model_dir, tmp_path_factory.mktemp("tiny-llama-chat") / "model")
    return TinyModel(arch="llama", model_dir=model_dir, adapters=tiny_llama.adapters, config=tiny_llama.config)


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma2"), "gemma2", seed=4)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", seed=5)


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-phi3"), "phi3", seed=6)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=3)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=2)


@functools.lru_cache(maxsize=8)
def _hf_model(model_dir: str, adapters: tuple[tuple[str, str], ...], dequantize: bool = False):
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if dequantize:  # compressed-tensors: dequantize every weight at load instead of at the first forward
        from transformers import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    model.eval()
    quant = getattr(model.config, "quantization_config", None)
    if quant is not None and not dequantize and _quant_method(quant) == "compressed-tensors":
        # compressed-tensors decompresses a layer at its first forward; PEFT reads .weight before that
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long))
    if not adapters:
        return model
    from peft import PeftModel

    (first_name, first_path), *rest = adapters
    peft_model = PeftModel.from_pretrained(model, first_path, adapter_name=first_name)
    for name, path in rest:
        peft_model.load_adapter(path, adapter_name=name)
    peft_model.eval()
    return peft_model


def _quant_method(quant) -> str | None:
    return quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)


def _adapter_key(adapters: Mapping[str, str | Path]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, str(path)) for name, path in adapters.items()))


def hf_reference_generate(
    model_dir: str | Path,
    adapters: Mapping[str, str | Path],
    prompts_token_ids: Sequence[Sequence[int]],
    adapter_per_prompt: Sequence[str | None],
    max_new_tokens: int,
    mixed: bool = True,
    dequantize: bool = False,
    **generate_kwargs,
) -> HFReference:
    """Greedy tokens (and the raw logits behind them) from transformers + PEFT; see the module docstring.
    generate_kwargs go to `generate` (logits processors such as sequence_bias, bad_words_ids, eos_token_id);
    dequantize: a compressed-tensors checkpoint is dequantized at load (CompressedTensorsConfig(dequantize=True))."""
    names = [BASE if a is None else a for a in adapter_per_prompt]
    used = {n for n in names if n != BASE}
    model = _hf_model(str(model_dir), _adapter_key({n: adapters[n] for n in used}), dequantize)
    groups = [list(range(len(prompts_token_ids)))] if mixed else [[i] for i in range(len(prompts_token_ids))]
    token_ids: list[list[int]] = [[] for _ in prompts_token_ids]
    logits: list[torch.Tensor] = [torch.empty(0) for _ in prompts_token_ids]
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    for group in groups:
        longest = max(len(prompts_token_ids[i]) for i in group)
        ids = torch.full((len(group), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(group), longest), dtype=torch.long)
        for row, i in enumerate(group):
            prompt = list(prompts_token_ids[i])
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        kwargs = {"eos_token_id": None, **generate_kwargs}
        # one adapter loaded and every row on it: it is the active one (PEFT's GPTQ and AWQ LoRA layers take no
        # adapter_names)
        if used and not (len(used) == 1 and all(names[i] != BASE for i in group)):
            kwargs["adapter_names"] = [names[i] for i in group]
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                output_logits=True,
                return_dict_in_generate=True,
                **kwargs,
            )
        step_logits = torch.stack(out.logits, dim=1).float()  # [rows, new, V]
        for row, i in enumerate(group):
            token_ids[i] = out.sequences[row, longest:].tolist()
            logits[i] = step_logits[row]
    return HFReference(token_ids=token_ids, logits=logits)


def hf_greedy_choices(
    model_dir: str | Path,
    adapters: Mapping[str, str | Path],
    prompts_token_ids: Sequence[Sequence[int]],
    adapter_per_prompt: Sequence[str | None],
    generated: Sequence[Sequence[int]],
) -> list[list[int]]:
    """transformers + PEFT's greedy choice (fp32) at each step of `generated[i]`, given `prompts_token_ids[i]` and the
    tokens before it, from one forward over the whole sequence: `generated[i]` is what greedy generation with
    transformers + PEFT gives exactly when it equals the list returned for it (each token is the argmax after its
    prefix), at the cost of one forward instead of one per token."""
    names = [BASE if a is None else a for a in adapter_per_prompt]
    used = {n for n in names if n != BASE}
    model = _hf_model(str(model_dir), _adapter_key({n: adapters[n] for n in used}))
    choices = []
    for prompt, ids, name in zip(prompts_token_ids, generated, names):
        kwargs = {"adapter_names": [name]} if used else {}
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[*prompt, *ids]]), **kwargs).logits[0]
        choices.append(logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)].argmax(-1).tolist())
    return choices


def hf_reference_logits(
    model_dir: str | Path, adapter_path: str | Path | None, token_ids: Sequence[int]
) -> torch.Tensor:
    """fp32 logits [len(token_ids), V] of one full forward, with the adapter at `adapter_path` (or none)."""
    adapters = {} if adapter_path is None else {"ref": adapter_path}
    model = _hf_model(str(model_dir), _adapter_key(adapters))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(token_ids)]))
    return out.logits[0].float()
