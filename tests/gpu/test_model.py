"""Our Llama/Qwen2 forward against transformers + PEFT logits (fp32, 1e-4), over a paged cache with block_size 4."""

from __future__ import annotations

import random

import pytest
import torch

from loraledger.gpu.dense import prepack_supported
from loraledger.gpu.forward_batch import build_forward_batch, order_for_batch
from loraledger.gpu.kv_cache import KVCache
from loraledger.gpu.model import Model
from loraledger.gpu.ops_cuda import CudaOps
from loraledger.gpu.ops_torch import TorchOps
from loraledger.gpu.weights import load_weights
from loraledger.lora.checkpoint_reader import load_lora_checkpoint
from loraledger.lora.device_slots import LoraSlots
from loraledger.scheduling.step_plan import SeqWork
from tests.gpu.cuda_emulation import EmulatedLauncher, emulation_problem
from tests.model_fixtures import TinyModel, hf_reference_logits

BLOCK_SIZE = 4
NUM_BLOCKS = 64
ADAPTER_NAMES = ["qv_r4", "all_r8", "ogd_r16_rslora"]


class PagedModel:
    """Our model with every adapter loaded (slot i = ADAPTER_NAMES[i]) and a trivial block allocator."""

    def __init__(self, tiny: TinyModel, prepack: bool | None = None, ops=None) -> None:
        cfg = tiny.config
        self.ops = ops or TorchOps()
        self.slots = LoraSlots(cfg, max_loras=len(ADAPTER_NAMES), max_lora_rank=16, dtype=torch.float32, device="cpu")
        for slot, name in enumerate(ADAPTER_NAMES):
            ckpt = load_lora_checkpoint(
                str(tiny.adapters[name]), lora_name=name, lora_int_id=slot + 1, model_config=cfg, max_lora_rank=16
            )
            self.slots.load(slot, ckpt)
        weights = load_weights(tiny.model_dir, cfg, dtype=torch.float32, device="cpu")
        self.model = Model(cfg, weights, self.ops, lora_slots=self.slots, prepack=prepack)
        self.kv = KVCache(cfg, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
        self.free = list(range(NUM_BLOCKS))
        random.Random(0).shuffle(self.free)  # scattered, non-contiguous block tables

    def new_table(self, length: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-length // BLOCK_SIZE))]

    def step(self, works: list[SeqWork]) -> dict[int, torch.Tensor]:
        """Run one forward; return each sequence's logits for every token it ran (all rows requested)."""
        ordered, num_decode = order_for_batch(works)
        batch, layout = build_forward_batch(
            ordered, num_decode, block_size=BLOCK_SIZE, device=torch.device("cpu"), ops=self.ops, lora_slots=self.slots
        )
        logits = self.model.forward(batch, self.kv)
        out = {}
        for i, w in enumerate(ordered):
            start, count = int(layout.logits_start[i]), int(layout.logits_count[i])
            out[w.seq_id] = logits[start : start + count]
        return out


def _work(seq_id, tokens, start, table, slot):
    return SeqWork(seq_id, tokens, start, table, slot, sample=True, prompt_logprobs=True)


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request) -> TinyModel:
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.mark.parametrize("adapter", [None, *ADAPTER_NAMES])
def test_chunked_prefill_then_decode_matches_hf(tiny, adapter):
    paged = PagedModel(tiny)
    slot = -1 if adapter is None else ADAPTER_NAMES.index(adapter)
    tokens = [1, 17, 250, 33, 8, 402, 96, 11, 300, 45, 7, 123, 5, 88, 61]  # 9 prompt + 6 decode tokens
    expect = hf_reference_logits(tiny.model_dir, None if adapter is None else tiny.adapters[adapter], tokens)
    table = paged.new_table(len(tokens))
    # prompt in two chunks (the second attends to the cached first), then one token per step
    chunks = [(0, 5), (5, 9)] + [(p, p + 1) for p in range(9, len(tokens))]
    for lo, hi in chunks:
        got = paged.step([_work(0, tokens[lo:hi], lo, table, slot)])[0]
        torch.testing.assert_close(got, expect[lo:hi], rtol=0, atol=1e-4)


# prepack True: oneDNN pre-packed projections (the CPU default); False: F.linear (the GPU's and bf16's path)
@pytest.mark.parametrize("prepack", [True, False] if prepack_supported("cpu", torch.float32) else [False])
def test_mixed_batch_of_base_and_every_adapter_matches_hf_per_sequence(tiny, prepack):
    paged = PagedModel(tiny, prepack=prepack)
    assert all(layer.qkv.prepacked == prepack for layer in paged.model.layers)
    seqs = {
        0: ([1, 5, 9, 200, 33, 71, 14], -1),
        1: ([1, 7, 7, 301, 2, 99], 0),
        2: ([1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109], 1),
        3: ([1, 42], 2),
    }
    continuation = [60, 61, 62, 63, 64]
    expect, tables = {}, {}
    for sid, (prompt, slot) in seqs.items():
        full = prompt + continuation
        adapter = None if slot < 0 else tiny.adapters[ADAPTER_NAMES[slot]]
        expect[sid] = hf_reference_logits(tiny.model_dir, adapter, full)
        tables[sid] = paged.new_table(len(full))
    done = {sid: 0 for sid in seqs}
    # staggered: sequence 2 prefills in chunks of 4 while the others already decode in the same steps
    for _ in range(8):
        works = []
        for sid, (prompt, slot) in seqs.items():
            full = prompt + continuation
            lo = done[sid]
            if lo >= len(full):
                continue
            hi = lo + 1 if lo >= len(prompt) else (min(lo + 4, len(prompt)) if sid == 2 else len(prompt))
            works.append(_work(sid, full[lo:hi], lo, tables[sid], slot))
            done[sid] = hi
        results = paged.step(works)
        for w in works:
            torch.testing.assert_close(
                results[w.seq_id], expect[w.seq_id][w.start_pos : w.start_pos + len(w.token_ids)], rtol=0, atol=1e-4
            )
    assert all(done[sid] == len(seqs[sid][0]) + len(continuation) for sid in seqs)


def test_cuda_kernels_in_the_whole_forward_emulated(tiny_llama):
    """CudaOps' kernels (CPU emulation, compute capability 9.0: the fused LoRA kernel) in the real forward:
    a mixed decode step over adapters of ranks 4, 8 and 16 in rank-16 slots (the kernels skip each slot's
    zero rank rows) and the base model, against transformers + PEFT."""
    problem = emulation_problem()
    if problem is not None:
        pytest.skip(problem)
    ops = CudaOps("cpu", launcher=EmulatedLauncher(sm_count=4))
    paged = PagedModel(tiny_llama, prepack=False, ops=ops)
    assert paged.slots.ranks.tolist() == [4, 8, 16]
    prompts = {
        0: ([1, 5, 9, 200, 33], -1),
        1: ([1, 7, 7, 301], 0),
        2: ([1, 100, 101, 102, 103, 104], 1),
        3: ([1, 42], 2),
    }
    nxt = [60, 61]
    tables = {sid: paged.new_table(len(p) + len(nxt)) for sid, (p, _) in prompts.items()}
    paged.step([_work(sid, p, 0, tables[sid], slot) for sid, (p, slot) in prompts.items()])
    for k, token in enumerate(nxt):
        got = paged.step([_work(sid, [token], len(p) + k, tables[sid], slot) for sid, (p, slot) in prompts.items()])
        for sid, (p, slot) in prompts.items():
            adapter = None if slot < 0 else tiny_llama.adapters[ADAPTER_NAMES[slot]]
            expect = hf_reference_logits(tiny_llama.model_dir, adapter, p + nxt[: k + 1])
            torch.testing.assert_close(got[sid][0], expect[-1], rtol=0, atol=1e-4)


def test_logits_only_at_requested_rows(tiny_llama):
    paged = PagedModel(tiny_llama)
    table = paged.new_table(6)
    work = SeqWork(seq_id=0, token_ids=[1, 2, 3, 4, 5, 6], start_pos=0, block_table=table, lora_slot=-1, sample=True)
    logits = paged.step([work])[0]
    assert logits.shape == (1, tiny_llama.config.vocab_size)
    expect = hf_reference_logits(tiny_llama.model_dir, None, [1, 2, 3, 4, 5, 6])
    torch.testing.assert_close(logits[0], expect[-1], rtol=0, atol=1e-4)


def _windowed_model(tmp_path, arch: str):
    """A tiny Mistral (window 5 on every layer) or Qwen2 (use_sliding_window, window 5 from layer 2 of 3 on,
    max_window_layers=2: transformers' per-layer layer_types) saved by transformers."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        sliding_window=5,
        initializer_range=0.1,
    )
    if arch == "mistral":
        MistralForCausalLM(MistralConfig(num_hidden_layers=2, **common)).save_pretrained(tmp_path)
    else:
        hf_cfg = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, max_window_layers=2, **common)
        Qwen2ForCausalLM(hf_cfg).save_pretrained(tmp_path)


@pytest.mark.parametrize("arch, windows", [("mistral", (5, 5)), ("qwen2", (None, None, 5))])
def test_sliding_window_layers_match_hf(tmp_path, arch, windows):
    """transformers' rule: Mistral's window on every layer, Qwen2's only on layers >= max_window_layers."""
    _windowed_model(tmp_path, arch)
    from loraledger.gpu.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(tmp_path)
    assert (cfg.architecture, cfg.sliding_window, cfg.layer_windows) == (arch, 5, windows)
    tokens = [1, 9, 17, 33, 8, 42, 96, 11, 30, 45, 7, 12, 5]
    expect = hf_reference_logits(tmp_path, None, tokens)
    ops = TorchOps()
    model = Model(cfg, load_weights(tmp_path, cfg, dtype=torch.float32, device="cpu"), ops)
    kv = KVCache(cfg, 16, BLOCK_SIZE, torch.float32, "cpu")
    table = [7, 2, 12, 0]
    for lo, hi in [(0, 6), (6, 9)] + [(p, p + 1) for p in range(9, len(tokens))]:
        work = SeqWork(0, tokens[lo:hi], lo, table, -1, True, True)
        ordered, num_decode = order_for_batch([work])
        batch, _ = build_forward_batch(
            ordered, num_decode, block_size=BLOCK_SIZE, device=torch.device("cpu"), ops=ops, lora_slots=None
        )
        torch.testing.assert_close(model.forward(batch, kv), expect[lo:hi], rtol=0, atol=1e-4)


def test_layer_windows_from_a_config_without_layer_types():
    """Older config.json files carry no layer_types: Qwen2 windows layers >= max_window_layers (default 28), only
    with use_sliding_window; Mistral every layer; a malformed layer_types list is refused."""
    from loraledger.errors import ModelLoadError
    from loraledger.gpu.model_config import ModelConfig

    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=30, num_attention_heads=4, vocab_size=128)
    qwen = ModelConfig.from_dict(
        {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 7, "use_sliding_window": True}
    )
    assert qwen.layer_windows == (None,) * 28 + (7, 7)
    off = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 7})
    assert off.layer_windows == (None,) * 30 and off.sliding_window is None
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 7})
    assert mistral.layer_windows == (7,) * 30
    with pytest.raises(ModelLoadError, match="layer_types must list"):
        ModelConfig.from_dict(
            {**base, "architectures": ["MistralForCausalLM"], "sliding_window": 7, "layer_types": ["full_attention"]}
        )
