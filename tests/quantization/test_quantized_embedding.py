"""QuantizedEmbedding: a GGUF token embedding and lm_head kept quantized on the CPU: rows looked up from the packed
bytes, the lm_head on the int4 kernel, greedy ids as transformers' on the same file."""

import pytest
import torch
import torch.nn.functional as F

from loraledger.gpu import base_model
from loraledger.quantization.affine import AffineWeight
from loraledger.quantization.quantized_embedding import QuantizedEmbedding, four_bit_parts
from tests.model_fixtures import hf_reference_generate
from tests.quantization.quantized_checkpoints import write_gguf
from tests.quantization.test_quantized_engine import (
    MAX_NEW,
    _batch,
    _check_near_ties,
    _engine,
    transformers_gguf_copy,
)


def _q8(rows: int, cols: int) -> AffineWeight:
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 256, (rows, cols), dtype=torch.int32, generator=g)
    scale = (torch.rand(rows, cols // 32, generator=g) * 0.01).to(torch.bfloat16).float()
    return AffineWeight(q, scale, -128.0 * scale, 8)


def test_an_8_bit_weight_splits_exactly_into_two_4_bit_parts():
    w = _q8(48, 64)
    parts = four_bit_parts(w)
    assert [p.bits for p in parts] == [4, 4]
    assert all(int(p.q.min()) >= 0 and int(p.q.max()) < 16 for p in parts)
    assert torch.equal(sum(p.dense() for p in parts), w.dense())


def test_lookup_and_lm_head_read_the_same_packed_bytes():
    w = _q8(176, 64)  # two 64-row blocks and a 48-row tail
    emb = QuantizedEmbedding(w)
    assert emb.paths == ["int4pack", "int4pack"]
    assert emb.resident_bytes() <= 0.65 * 176 * 64 * 2
    ids = torch.tensor([[0, 63, 64], [127, 128, 175]])
    assert torch.equal(emb.lookup(ids), w.dense()[ids].to(torch.bfloat16))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = F.linear(x.float(), w.dense())
    torch.testing.assert_close(emb(x), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize(("embedding", "tied"), [("Q8_0", True), ("Q4_0", False)])
def test_a_gguf_with_a_quantized_embedding_keeps_it_packed_and_matches_transformers(
    embedding, tied, tiny_llama, tmp_path
):
    path = write_gguf(tiny_llama.model_dir, tmp_path / f"tiny.{embedding}.gguf", "Q4_0", embedding, tied)
    config = base_model.read_config(path)
    weights = base_model.load_base(path, config, dtype=torch.bfloat16, device="cpu",
                                   quantization=base_model.read_quantization(path))  # fmt: skip
    assert isinstance(weights.embed, QuantizedEmbedding) and isinstance(weights.lm_head, QuantizedEmbedding)
    assert (weights.lm_head is weights.embed) == tied
    assert set(weights.embed.paths) == {"int4pack"}
    reference = transformers_gguf_copy(path, tiny_llama.model_dir, tmp_path / "transformers")
    loras, names, prompts = _batch(tiny_llama)
    ref = hf_reference_generate(reference, tiny_llama.adapters, prompts, names, MAX_NEW)
    assert _engine(path, tiny_llama.model_dir, "float32", tiny_llama, prompts, names, loras) == ref.token_ids
    _check_near_ties(_engine(path, tiny_llama.model_dir, "bfloat16", tiny_llama, prompts, names, loras), ref)
