"""The benchmark's model, tokenizer and adapters, built once under bench/.cache/ and reused by every run.

The shapes are fixed: a Llama-shaped random model (hidden 512, 8 layers, 8 query / 2 KV heads,
intermediate 1344, vocab 32,000, fp32), 8 rank-16 PEFT adapters on all seven projections, and for
the churn scenario 1,000 rank-8 adapters. Each folder is written under a temporary name and renamed
when complete, so an interrupted build is redone rather than half-used.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from loraledger.assets import SPECIAL_TOKENS, build_random_adapter, build_random_checkpoint
from loraledger.gpu.model_config import LORA_TARGETS

CACHE = Path(__file__).resolve().parent / ".cache"

MODEL_SHAPE = dict(
    arch="llama",
    hidden_size=512,
    intermediate_size=1344,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    vocab_size=32_000,
    max_position_embeddings=1024,
    seed=6,
)
NUM_ADAPTERS = 8
ADAPTER_RANK = 16
CHURN_RANK = 8

# printable characters (in byte-level form: "Ġ" is the space) that the synthetic merges are spelled with
_MERGE_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789Ġ"


@dataclass(frozen=True)
class BenchAssets:
    model_dir: Path
    adapters: list[Path]  # the NUM_ADAPTERS rank-16 adapters, index = adapter number

    @property
    def vocab_size(self) -> int:
        return int(MODEL_SHAPE["vocab_size"])


def model_assets(cache: Path = CACHE) -> BenchAssets:
    """The model folder (weights + 32k tokenizer) and the 8 rank-16 adapters, built on first use."""
    model_dir = build_once(cache / "llama-h512-l8", _write_model)
    names = [f"r{ADAPTER_RANK}-{i}" for i in range(NUM_ADAPTERS)]
    adapters = random_adapters(model_dir, cache / "adapters", names, rank=ADAPTER_RANK, first_seed=1000)
    return BenchAssets(model_dir=model_dir, adapters=adapters)


def churn_adapters(count: int, cache: Path = CACHE) -> list[Path]:
    """`count` rank-8 adapters on all seven projections (about 2.3 MB each), built on first use."""
    model_dir = model_assets(cache).model_dir
    names = [f"r{CHURN_RANK}-{i:04d}" for i in range(count)]
    return random_adapters(model_dir, cache / "churn", names, rank=CHURN_RANK, first_seed=50_000)


def random_adapters(model_dir: Path, folder: Path, names: list[str], *, rank: int, first_seed: int) -> list[Path]:
    """Rank-`rank` adapters (alpha 2 * rank) on all seven projections, folder / name each, built on
    first use; the i-th gets seed first_seed + i."""
    return [
        build_once(
            folder / name,
            lambda out, i=i: build_random_adapter(
                out, model_dir, rank=rank, alpha=2 * rank, target_modules=LORA_TARGETS, seed=first_seed + i
            ),
        )
        for i, name in enumerate(names)
    ]


def build_once(final: Path, write) -> Path:
    if final.is_dir():
        return final
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    write(partial)
    partial.rename(final)
    return final


def _write_model(out: Path) -> None:
    build_random_checkpoint(out, **MODEL_SHAPE)
    write_tokenizer(out, int(MODEL_SHAPE["vocab_size"]))


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, its merges made up rather than trained.

    loraledger.assets.build_tokenizer trains on a small corpus and stops near a thousand ids; the
    benchmark needs the full 32k so that every generated id detokenizes (as it would with a real
    Llama tokenizer). Ids 0..3 are the special tokens, then the 256 byte symbols, then merges that
    spell every 2- and 3-character string over `_MERGE_CHARS` until the vocabulary is full.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    frontier = list(_MERGE_CHARS)
    while len(vocab) < vocab_size:
        grown = []
        for prefix in frontier:
            for ch in _MERGE_CHARS:
                if len(vocab) >= vocab_size:
                    break
                token = prefix + ch
                vocab[token] = len(vocab)
                merges.append((prefix, ch))
                grown.append(token)
        frontier = grown
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bos = SPECIAL_TOKENS.index("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(str(out_dir))
