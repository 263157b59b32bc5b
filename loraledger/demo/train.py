"""Fine-tune one LoRA adapter on chat examples and save it as a PEFT folder: the demo's trainer.

Each example is the chat template's prompt for the user's question, then the answer and the end-of-turn token;
the loss is on the answer's tokens only. Only the top `top_layers` layers carry LoRA, so the lower layers run
once per example (LoraLlama.lower) and each step runs the top ones alone: that is what makes the demo's first
run take a minute or two on a laptop's CPU rather than ten.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from loraledger.demo.data import Example
from loraledger.demo.lora_model import ATTENTION, MLP, LlamaShape, LoraLlama


@dataclass(frozen=True)
class TrainSpec:
    """How one adapter is trained."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ATTENTION + MLP
    top_layers: int = 6  # LoRA on the last `top_layers` layers (PEFT's layers_to_transform)
    steps: int = 25
    batch_size: int = 8
    learning_rate: float = 3e-3
    seed: int = 0


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class Encoded:
    token_ids: list[int]
    answer_start: int  # index of the answer's first token in token_ids


def encode(tokenizer, examples: Sequence[Example]) -> list[Encoded]:
    """Prompt ids as the engine's chat renders them (the template's text, tokenized without special tokens
    added), then the answer's ids and the end-of-turn token's."""
    out = []
    for ex in examples:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": ex.question}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append(Encoded(list(prompt_ids) + list(answer_ids), len(prompt_ids)))
    return out


def train_adapter(
    weights: Mapping[str, torch.Tensor],
    config: Mapping,
    tokenizer,
    examples: Sequence[Example],
    spec: TrainSpec,
    *,
    progress: Callable[[int, int, float], None] | None = None,
) -> tuple[LoraLlama, TrainResult]:
    """Train the adapter; `progress(step, steps, loss)` is called after each step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(training_threads())
    try:
        return _train(weights, config, tokenizer, examples, spec, progress)
    finally:
        torch.set_num_threads(threads)


def training_threads() -> int:
    """Intra-op threads for training: every core on a quiet machine, fewer on a busy one (on a two-core machine
    already running other work, two threads made each step 3-4x slower than one: they wait on each other)."""
    cores = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return cores
    return max(1, min(cores, round((os.cpu_count() or cores) - load)))


def _train(weights, config, tokenizer, examples, spec, progress) -> tuple[LoraLlama, TrainResult]:
    shape = LlamaShape.from_config(config)
    torch.manual_seed(spec.seed)
    model = LoraLlama(
        weights,
        shape,
        first_lora_layer=max(0, shape.num_layers - spec.top_layers),
        targets=spec.targets,
        rank=spec.rank,
        alpha=spec.alpha,
        seed=spec.seed,
    )
    started = time.perf_counter()
    data = encode(tokenizer, examples)
    batches = Batches(model, data)
    optimizer = torch.optim.AdamW(model.lora.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (spec.steps + 1))
    rng = random.Random(spec.seed)
    order: list[int] = []
    result = TrainResult(steps=spec.steps)
    for step in range(spec.steps):
        if len(order) < spec.batch_size:
            fresh = list(range(len(data)))
            rng.shuffle(fresh)
            order += fresh
        batch, order = order[: spec.batch_size], order[spec.batch_size :]
        loss = batches.loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        result.losses.append(loss.detach().item())
        if progress is not None:
            progress(step + 1, spec.steps, result.losses[-1])
    result.seconds = time.perf_counter() - started
    return model, result


class Batches:
    """The training lines cut at the prefix they all share, with what the frozen lower layers make of them
    computed once; `loss(indices)` runs the top layers on a batch of them."""

    def __init__(self, model: LoraLlama, data: Sequence[Encoded], chunk: int = 16) -> None:
        self.model = model
        self.data = data
        # the shared prefix ends before the first answer token's predecessor, which must be in every line's part
        shared = min(_common_prefix([e.token_ids for e in data]), min(e.answer_start for e in data) - 1)
        self.prefix = torch.tensor([data[0].token_ids[:shared]], dtype=torch.long)
        lower = range(model.first_lora_layer)
        with torch.no_grad():
            self.prefix_hidden, prefix_kv = model.run(model.embed(self.prefix), lower) if shared else (None, None)
            self.hidden: list[torch.Tensor | None] = [None] * len(data)
            by_length = sorted(range(len(data)), key=lambda i: len(data[i].token_ids))
            for start in range(0, len(by_length), chunk):
                idx = by_length[start : start + chunk]
                ids = _pad([data[i].token_ids[shared:] for i in idx])
                hidden, _ = model.run(model.embed(ids), lower, shared, prefix_kv)
                for row, i in enumerate(idx):
                    self.hidden[i] = hidden[row, : len(data[i].token_ids) - shared].clone()
        self.shared = shared

    def loss(self, indices: Sequence[int]) -> torch.Tensor:
        model, shared = self.model, self.shared
        upper = range(model.first_lora_layer, model.shape.num_layers)
        past = model.run(self.prefix_hidden, upper)[1] if shared else None  # once per step: LoRA changes it
        parts = [self.hidden[i] for i in indices]
        h = torch.zeros(len(parts), max(p.shape[0] for p in parts), parts[0].shape[-1])
        for row, states in enumerate(parts):
            h[row, : states.shape[0]] = states
        hidden, _ = model.run(h, upper, shared, past)
        # position t predicts token t + 1: the answer's tokens are predicted from answer_start - 1 on
        rows, positions, targets = [], [], []
        for row, i in enumerate(indices):
            e = self.data[i]
            n = len(e.token_ids) - e.answer_start
            rows += [row] * n
            positions += range(e.answer_start - 1 - shared, len(e.token_ids) - 1 - shared)
            targets += e.token_ids[e.answer_start :]
        picked = model.final_norm(hidden[torch.tensor(rows), torch.tensor(positions)])
        return F.cross_entropy(model.logits(picked), torch.tensor(targets))


def _common_prefix(rows: Sequence[Sequence[int]]) -> int:
    first = rows[0]
    n = min(len(r) for r in rows)
    for row in rows[1:]:
        while n and list(row[:n]) != list(first[:n]):
            n -= 1
    return n


def _pad(rows: Sequence[Sequence[int]], pad_id: int = 0) -> torch.Tensor:
    longest = max(len(r) for r in rows)
    return torch.tensor([list(r) + [pad_id] * (longest - len(r)) for r in rows], dtype=torch.long)


def save_peft_adapter(model: LoraLlama, out_dir: Path, *, base_model: str, spec: TrainSpec) -> Path:
    """adapter_config.json and adapter_model.safetensors as PEFT writes them for a LoRA on `base_model`."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(spec.targets),
        "layers_to_transform": model.lora_layers,
        "layers_pattern": None,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(model.peft_state(), str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out_dir


def print_progress(name: str, stream=sys.stderr) -> Callable[[int, int, float], None]:
    """A one-line progress bar: `  pirate  [######----]  24/40 steps  loss 0.412`."""

    def show(step: int, steps: int, loss: float) -> None:
        filled = round(20 * step / steps)
        bar = "#" * filled + "-" * (20 - filled)
        end = "\n" if step == steps else ""
        stream.write(f"\r  training {name:<7} [{bar}] {step:>3}/{steps} steps  loss {loss:.3f}{end}")
        stream.flush()

    return show
