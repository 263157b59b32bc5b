"""The demo on a small random model and three random adapters, built locally with no download: what
`loraledger demo --random-model` runs, and what the demo falls back to when the package index cannot be reached.
Its text is noise by design; what it shows is which adapter wrote each answer, and that every answer is on record.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

RANDOM_DIR = "random-v1"
RANDOM_ADAPTERS = {  # name -> (rank, alpha, target modules, seed)
    "sql": (8, 16.0, ("q_proj", "v_proj"), 11),
    "poet": (16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 12),
    "support": (4, 8.0, ("o_proj", "gate_proj", "down_proj"), 13),
}
RANDOM_PROMPTS = [
    ("What is the capital of France?", None),
    ("Convert to SQL: all users older than 30", "sql"),
    ("Write a short poem about the sea", "poet"),
    ("My order has not arrived yet", "support"),
    ("Convert to SQL: count orders per day", "sql"),
    ("Tell me about the history of paper", None),
]


def random_assets(cache_dir: Path, rebuild: bool = False) -> tuple[Path, dict[str, Path]]:
    """The random model and adapters under cache_dir/demo/random-v1, built once."""
    from loraledger import assets

    root = cache_dir / "demo" / RANDOM_DIR
    model_dir = root / "model"
    adapter_dirs = {name: root / "adapters" / name for name in RANDOM_ADAPTERS}
    done = root / ".complete"
    if rebuild and root.exists():
        shutil.rmtree(root)
    if not done.exists():
        print(f"building the random demo model and adapters under {root} (once) ...", file=sys.stderr)
        root.mkdir(parents=True, exist_ok=True)
        assets.build_tokenizer(model_dir, vocab_size=1024)
        assets.build_random_checkpoint(
            model_dir,
            arch="llama",
            hidden_size=256,
            intermediate_size=688,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            vocab_size=1024,
            max_position_embeddings=1024,
            seed=7,
        )
        for name, (rank, alpha, targets, seed) in RANDOM_ADAPTERS.items():
            assets.build_random_adapter(
                adapter_dirs[name], model_dir, rank=rank, alpha=alpha, target_modules=list(targets), seed=seed
            )
        done.write_text("ok\n")
    return model_dir, adapter_dirs


def run_random(cache_dir: Path, url: str, *, max_tokens: int, device: str, rebuild: bool = False) -> int:
    from loraledger import LLM, LoRARequest, SamplingParams
    from loraledger.generate_command import print_table

    model_dir, adapter_dirs = random_assets(cache_dir, rebuild)
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapter_dirs.items())}
    with LLM(
        model=str(model_dir),
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        max_cpu_loras=8,
        audit_url=url,
        device=device,
    ) as llm:
        outputs = llm.generate(
            [p for p, _ in RANDOM_PROMPTS],
            SamplingParams(temperature=0, max_tokens=max_tokens),
            lora_request=[loras[a] if a else None for _, a in RANDOM_PROMPTS],
            use_tqdm=False,
        )
    print("The demo model and its three adapters have random weights: the text is noise by design.")
    print("What matters is which adapter wrote each answer, and that every answer is on record.\n")
    print_table(outputs)
    print(f"\naudit log: {url}")
    print("every row above is on record; look one up by its audit key (or any unique prefix of it), or check the log:")
    print(f"  loraledger audit show {outputs[0].audit_id}")
    print("  loraledger audit verify")
    print("or in SQL:")
    print("  SELECT request_id, lora_name, adapter_fingerprint, finish_reason, text")
    print("  FROM request_lineage ORDER BY received_at DESC LIMIT 6;")
    return 0
