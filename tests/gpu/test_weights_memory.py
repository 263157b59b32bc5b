"""The CPU ModelRunner holds the base weights once: resident memory grows by about the checkpoint's size at load.

In a fresh process (nothing else allocated or mapped yet), a random tied-embedding model of ~150 MB: the
growth of resident memory (anonymous + file-backed) over the ModelRunner's construction stays within the
weights in the compute dtype, plus the KV cache, plus a small allowance. Before, the load's mapping of the whole
file stayed resident, the plain weights the pre-packed copies replaced stayed in glibc's heap, and the tied
embedding sat beside its packed lm_head copy: about 2.3x the weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")

SLACK = 48 << 20  # allocator and oneDNN bookkeeping, the rotary tables, the sampler's buffers

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from loraledger.gpu.model_runner import ModelRunner
    from loraledger.gpu.ops_torch import TorchOps

    def resident():
        fields = {}
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                fields[key] = int(value.split()[0]) * 1024 if key.startswith(("Rss", "VmRSS")) else 0
        return fields["VmRSS"]

    torch.set_num_threads(1)
    torch.zeros(1) @ torch.zeros(1)  # torch's own first-use allocations before the baseline
    before = resident()
    runner = ModelRunner(
        sys.argv[1], dtype=getattr(torch, sys.argv[2]), device=torch.device("cpu"), ops=TorchOps(),
        num_kv_blocks=64, block_size=16, max_loras=1, max_lora_rank=8, enable_lora=False,
        max_num_batched_tokens=256,
    )
    print(json.dumps({"growth": resident() - before, "kv": runner.kv_cache.nbytes}))
    """
)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    from loraledger.assets import build_random_checkpoint

    out = tmp_path_factory.mktemp("mem") / "model"
    build_random_checkpoint(
        out,
        hidden_size=512,
        intermediate_size=1344,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        vocab_size=32_000,
        tie_word_embeddings=True,
    )
    return out


@pytest.mark.parametrize("dtype,bytes_per_weight", [("float32", 4), ("bfloat16", 2)])
def test_the_runner_holds_the_weights_once(tied_model, dtype, bytes_per_weight):
    file_bytes = (tied_model / "model.safetensors").stat().st_size  # fp32, the tied matrix once
    weights = file_bytes * bytes_per_weight // 4
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tied_model), dtype], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    bound = weights + got["kv"] + SLACK
    assert got["growth"] <= bound, (
        f"resident memory grew by {got['growth'] >> 20} MiB over the load, above the weights ({weights >> 20} MiB) "
        f"+ KV cache ({got['kv'] >> 20} MiB) + {SLACK >> 20} MiB"
    )
