"""A CPU engine right after load holds its weights, its KV cache and a bounded rest, and none of the stacks it does
not use: in a fresh process, `LLM(..., device="cpu", audit_url=None)` on a random tied model of SmolLM2-135M's
width (the bench's memory figure, `python -m bench.run --only vs-vllm-cpu --parts memory`, at a third of its depth).

The rest is Python with torch imported (~220 MiB here, most of it torch's own libraries), the tokenizer, the
engine's modules and threads. transformers (the tokenizer's folder is read by `tokenizers` alone, the folder's
generation_config.json by loraledger/generation_config_file.py; neither the load nor a plain request with a stop string
and logprobs imports it), SQLAlchemy and alembic (an audit store), xgrammar (a
constrained request) and what AutoConfig pulls in (accelerate, torch.distributed, sympy) are imported only where they
are used: a regression that imports them shows here first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")

# resident - weights - KV cache, MiB: the 300 MB (286 MiB) target; this model holds 248-255 over on an AMD EPYC
# (AVX512-BF16), fp32 and bf16 (the bench's full-depth model 271-276); the margin covers the spread of a loaded machine
REST_MIB = 286
NOT_AT_LOAD = ("sqlalchemy", "alembic", "xgrammar", "sympy", "accelerate", "loraledger.server", "transformers")

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from loraledger import LLM

    llm = LLM(model=sys.argv[1], device="cpu", dtype=sys.argv[2], audit_url=None, num_threads=1,
              kv_cache_bytes=64 << 20, max_num_seqs=8)
    with open("/proc/self/status") as fh:
        rss = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    defaults = llm.get_default_sampling_params()  # the folder's generation_config.json was read
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty) == (0.7, 20, 1.05), defaults
    # a plain request: detokenized, with a stop string and logprobs (each token's text alone)
    from loraledger import SamplingParams

    out = llm.generate(["The model reads tokens"], SamplingParams(max_tokens=6, stop=["zq"], logprobs=2, ignore_eos=True))
    assert out[0].outputs[0].logprobs
    loaded = sorted({name for name in sys.modules for top in sys.argv[3:] if name == top or name.startswith(top + ".")})
    llm.close()
    print(json.dumps({"rss": rss, "loaded": loaded}))
    """
)


@pytest.fixture(scope="module")
def smollm2_width_model(tmp_path_factory) -> Path:
    from loraledger.assets import build_random_checkpoint, build_tokenizer

    out = tmp_path_factory.mktemp("resident") / "model"
    build_random_checkpoint(
        out,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=10,
        num_heads=9,
        num_kv_heads=3,
        vocab_size=49_152,
        tie_word_embeddings=True,
    )
    build_tokenizer(out)
    # a generation_config.json as most Hub checkpoints ship one (Qwen2.5-Instruct's keys)
    generation = {
        "bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "pad_token_id": 2, "repetition_penalty": 1.05,
        "temperature": 0.7, "top_k": 20, "top_p": 0.8, "transformers_version": "4.42.3",
    }  # fmt: skip
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


@pytest.mark.parametrize("dtype,bytes_per_weight", [("float32", 4), ("bfloat16", 2)])
def test_resident_after_load_is_weights_kv_and_a_bounded_rest(smollm2_width_model, dtype, bytes_per_weight):
    weights = (smollm2_width_model / "model.safetensors").stat().st_size * bytes_per_weight // 4  # fp32 file
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(smollm2_width_model), dtype, *NOT_AT_LOAD],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [], f"imported at load though nothing there uses them: {got['loaded']}"
    rest = (got["rss"] - weights - (64 << 20)) >> 20
    assert rest <= REST_MIB, (
        f"resident {got['rss'] >> 20} MiB after load: {rest} MiB above the weights ({weights >> 20} MiB) and the KV "
        f"cache (64 MiB), more than {REST_MIB}"
    )
