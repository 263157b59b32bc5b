"""bench/gpu_quant_step.py's parts that need no GPU: the random W4A16 weights it serves (device layout, the spread of
bf16's random weights, a quarter of their bytes and less), the ratios it reports, and its refusal without a GPU."""

from __future__ import annotations

import torch

from bench import gpu_quant_step, gpu_step
from loraledger.gpu.backend import cuda_problem
from loraledger.gpu.model_config import ModelConfig
from loraledger.quantization.device_layout import DeviceQuantWeight

SMALL = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=300, tied=False)


def test_random_w4a16_weights_are_device_layout_parts_a_quarter_of_bf16(tmp_path):
    config = ModelConfig.from_pretrained(gpu_step.write_config(tmp_path / "small", SMALL))
    cpu = torch.device("cpu")
    quant = gpu_quant_step.w4a16_weights(config, torch.bfloat16, cpu)
    dense = gpu_step.random_weights(config, torch.bfloat16, cpu)
    for q, d in zip(quant.layers, dense.layers):
        for qp, dp in ((q.qkv, d.qkv), (q.o, d.o), (q.gate_up, d.gate_up), (q.down, d.down)):
            (part,) = qp
            assert isinstance(part, DeviceQuantWeight) and (part.out_features, part.in_features) == tuple(dp.shape)
            w = part.dequantize()
            assert 0.8 < float(w.std() / dp.float().std()) < 1.25  # the spread of normal(0, 1/sqrt(in))
            assert part.packed_bytes() <= dp.nbytes * (0.25 + 2 / 128)
    assert len(quant.layers) == config.num_hidden_layers and quant.lm_head.shape == dense.lm_head.shape


def test_the_ratios_are_tokens_per_second_side_by_side():
    rows = [
        {"weights": w, "batch": b, "adapters": a, "tokens_s": t}
        for w, b, a, t in [("w4a16", 8, 32, 90.0), ("w4a16", 8, 0, 100.0), ("bf16", 8, 32, 60.0), ("bf16", 8, 0, 80.0)]
    ]
    r = gpu_quant_step.ratios(rows, [8])
    assert r["adapters_over_base"] == {8: 0.9}
    assert r["w4a16_over_bf16"] == {8: {"32 adapters": 1.5, "no adapters": 1.25}}


def test_the_quant_comparison_needs_a_gpu(capsys):
    if cuda_problem() is None:
        return
    assert gpu_step.main(["--quant", "--shape", "8b"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
