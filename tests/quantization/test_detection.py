"""config.json's quantization_config → QuantScheme, and every scheme the engine does not run refused by name."""

import pytest

from loraledger.errors import QuantizationError
from loraledger.quantization import QuantScheme, detect_quantization


def _ct(num_bits=4, strategy="group", group_size=128, symmetric=True, fmt="pack-quantized", inputs=None):
    weights = {"num_bits": num_bits, "type": "int", "strategy": strategy, "symmetric": symmetric}
    if strategy == "group":
        weights["group_size"] = group_size
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
        }
    }


def test_float_checkpoint_has_no_scheme():
    assert detect_quantization({"hidden_size": 8}) is None


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_group_and_channel(bits, symmetric):
    got = detect_quantization(_ct(bits, "group", 64, symmetric))
    assert got == QuantScheme(method="compressed-tensors", bits=bits, group_size=64, symmetric=symmetric)
    channel = detect_quantization(_ct(bits, "channel", None, symmetric))
    assert channel.group_size is None and channel.bits == bits
    assert "per-channel" in channel.describe()


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (_ct(fmt="float-quantized"), "float-quantized"),
        (_ct(inputs={"num_bits": 8, "type": "float"}), "activations"),
        (_ct(num_bits=2), "2 bits"),
        (_ct(strategy="tensor"), "'tensor'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "'fp8'"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}}, "gemv"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 3}}, "3 bits"),
        ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "'fp4'"),
    ],
)
def test_unsupported_is_refused_naming_what_is_supported(config, needle):
    with pytest.raises(QuantizationError) as err:
        detect_quantization(config)
    assert needle in str(err.value) and "supported: compressed-tensors" in str(err.value)


def test_gptq_awq_bitsandbytes():
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}
    assert detect_quantization({"quantization_config": gptq}) == QuantScheme(
        method="gptq", bits=4, group_size=32, symmetric=False, desc_act=True
    )
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM"}
    assert detect_quantization({"quantization_config": awq}).group_size == 128
    bnb = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    assert detect_quantization({"quantization_config": bnb}).weight_type == "int8"


def test_requested_method_forces_or_checks():
    gptq = {"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1}}
    assert detect_quantization(gptq, "gptq").bits == 8
    with pytest.raises(QuantizationError, match="quantized with 'gptq'"):
        detect_quantization(gptq, "awq")
    with pytest.raises(QuantizationError, match="not a supported method"):
        detect_quantization(gptq, "fp8")
    with pytest.raises(QuantizationError, match="no quantization_config"):
        detect_quantization({}, "gptq")
    at_load = detect_quantization({}, "bitsandbytes")
    assert at_load.quantized_at_load and at_load.weight_type == "nf4"
