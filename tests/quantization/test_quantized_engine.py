"""Quantized base models served end to end on the CPU, base and adapters in one mixed batch, against transformers +
PEFT on the same quantized weights.

float32: the engine dequantizes the weights once, at load, so it and transformers compute with the same fp32
weights: greedy ids must be equal. bfloat16: the weights stay packed for torch's int4/int8 kernels (bf16
activations); greedy ids may part from the fp32 reference only at a near-tie (LOGIT_TIE)."""

from __future__ import annotations

import pytest
import torch

from loraledger import LLM, LoRARequest, SamplingParams
from loraledger.errors import QuantizationError
from loraledger.gpu import base_model
from loraledger.quantization.projection import QuantizedProjection
from tests.api.conftest import loras_for, random_prompts
from tests.model_fixtures import hf_reference_generate
from tests.quantization.quantized_checkpoints import (
    GGUF_KINDS,
    QUANTIZED_FORMATS,
    build_wide_llama,
    write_gguf,
    write_quantized,
)

MAX_NEW = 10
# bf16 activations and weights scales: the fp32 reference's margin between its greedy token and the engine's where the
# two first part (the tiny model's logits span about +-5)
LOGIT_TIE = 0.15

SERVED = ("ct-w4-g32-asym", "ct-w8-channel", "gptq-g_idx", "gptq-w8a16-g64", "awq", "bnb-int8", "nf4", "nf4-double-quant")  # fmt: skip
FORMATS = {name: QUANTIZED_FORMATS[name] for name in SERVED}


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    out = {name: write_quantized(tiny_llama.model_dir, root, m, **kw) for name, (m, kw) in FORMATS.items()}
    for kind in GGUF_KINDS:
        path = write_gguf(tiny_llama.model_dir, root / f"tiny.{kind}.gguf", kind)
        out[kind] = (path, transformers_gguf_copy(path, tiny_llama.model_dir, root / f"tiny-{kind}-transformers"))
    return out


def transformers_gguf_copy(path, tokenizer_dir, dest):
    """The GGUF file as transformers' own GGUF loader reads it (dequantized to fp32), saved as a float folder."""
    import json
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    shutil.copytree(tokenizer_dir, dest, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    (dest / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    save_file({k: v.clone() for k, v in model.state_dict().items()}, str(dest / "model.safetensors"))  # tied: apart
    return dest


def _batch(tiny_llama):
    loras = loras_for(tiny_llama)
    names = [None, *sorted(loras)] * 2
    return loras, names, random_prompts(len(names), seed=3)


def _engine(model, tokenizer, dtype, tiny_llama, prompts, names, loras, **kw):
    with LLM(model=str(model), tokenizer=str(tokenizer), device="cpu", dtype=dtype, enable_lora=True, max_loras=3,
             max_lora_rank=16, block_size=4, audit_url=None, **kw) as llm:  # fmt: skip
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
            lora_request=[loras[n] if n else None for n in names],
        )
    return [list(o.outputs[0].token_ids) for o in outs]


def test_q4_k_gguf_equals_transformers_peft(tiny_llama, tmp_path):
    """Q4_K (Q4_K_M's projections): super-blocks of 256, so a model whose rows are a whole number of them."""
    from tests.api.conftest import random_prompts

    model_dir, adapters = build_wide_llama(tmp_path)
    path = write_gguf(model_dir, tmp_path / "wide.Q4_K.gguf", "Q4_K")
    reference = transformers_gguf_copy(path, model_dir, tmp_path / "wide-Q4_K-transformers")
    assert base_model.read_quantization(path).weight_type == "Q4_K"
    loras = {name: LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(sorted(adapters.items()))}
    names = [None, "all_r8", "qv_r4"] * 2
    prompts = random_prompts(len(names), seed=8)
    ref = hf_reference_generate(reference, adapters, prompts, names, MAX_NEW)
    assert _engine(path, model_dir, "float32", None, prompts, names, loras) == ref.token_ids
    _check_near_ties(_engine(path, model_dir, "bfloat16", None, prompts, names, loras), ref)


def _check_near_ties(ours, ref):
    """Where the engine's greedy ids part from the reference's, the reference's logits there are a near-tie."""
    for i, (a, b) in enumerate(zip(ours, ref.token_ids)):
        at = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None:
            continue
        logits = ref.logits[i][at]
        margin = float(logits[b[at]] - logits[a[at]])
        assert margin < LOGIT_TIE, f"prompt {i} parts at step {at} with a reference margin of {margin:.3f}"


@pytest.mark.parametrize("name", [*FORMATS, *GGUF_KINDS])
def test_greedy_ids_equal_transformers_peft_on_the_same_quantized_weights(name, checkpoints, tiny_llama):
    model, reference = checkpoints[name]
    loras, names, prompts = _batch(tiny_llama)
    ref = hf_reference_generate(reference, tiny_llama.adapters, prompts, names, MAX_NEW)
    assert _engine(model, tiny_llama.model_dir, "float32", tiny_llama, prompts, names, loras) == ref.token_ids
    _check_near_ties(_engine(model, tiny_llama.model_dir, "bfloat16", tiny_llama, prompts, names, loras), ref)


@pytest.mark.parametrize(
    ("name", "paths"),
    [
        ("gptq-g_idx", {"int4pack"}),
        ("awq", {"int4pack"}),
        ("bnb-int8", {"int8pack"}),
        ("Q4_1", {"int4pack"}),
    ],
)
def test_bf16_keeps_the_weights_packed_for_torchs_kernels(name, paths, checkpoints):
    model = checkpoints[name][0]
    scheme = base_model.read_quantization(model)
    config = base_model.read_config(model)
    weights = base_model.load_base(model, config, dtype=torch.bfloat16, device="cpu", quantization=scheme)
    projection = QuantizedProjection(weights.layers[0].gate_up, dtype=torch.bfloat16)
    assert set(projection.paths) == paths
    dense_bytes = projection.out_features * projection.in_features * 2
    assert projection.resident_bytes() <= (0.35 if 4 in (scheme.bits,) else 0.6) * dense_bytes


def test_quantization_argument_checks_the_checkpoint(checkpoints, tiny_llama):
    gptq = checkpoints["gptq-g_idx"][0]
    assert base_model.read_quantization(gptq, "gptq").method == "gptq"
    with pytest.raises(QuantizationError, match="quantized with 'gptq'"):
        base_model.read_quantization(gptq, "awq")
    with pytest.raises(QuantizationError, match="GGUF file"):
        base_model.read_quantization(checkpoints["Q4_0"][0], "gptq")
    with pytest.raises(QuantizationError, match="supported: .*gptq"):
        LLM(model=str(tiny_llama.model_dir), quantization="fp8", audit_url=None)
    with pytest.raises(QuantizationError, match="no quantization_config"):
        base_model.read_quantization(tiny_llama.model_dir, "awq")
    base_model.check_device(base_model.read_quantization(gptq), torch.device("cuda"))  # the device layout runs it
    with pytest.raises(QuantizationError, match="CPU or a CUDA GPU, not on meta"):
        base_model.check_device(base_model.read_quantization(gptq), torch.device("meta"))


def test_the_record_names_the_quantization_and_verify_covers_it(checkpoints, tiny_llama, tmp_path, capsys):
    import json

    from sqlalchemy import text

    from loraledger.audit import AuditLog
    from loraledger.audit.report import write_report
    from loraledger.cli import main
    from loraledger.gpu.weights import model_fingerprint

    model = checkpoints["Q4_1"][0]
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    with LLM(model=str(model), tokenizer=str(tiny_llama.model_dir), device="cpu", audit_url=url) as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3))
    request_id = out[0].audit_id
    with AuditLog(url) as log, log.snapshot() as conn:
        row = conn.execute(text("SELECT quantization, quant_method, quant_bits, quant_group_size FROM instances")).one()
        fingerprint = conn.execute(text("SELECT base_model_fingerprint FROM requests")).scalar_one()
    assert tuple(row) == ("gguf 4-bit g32 asym Q4_1", "gguf", 4, 32)
    # the fingerprint covers the GGUF file and the quantization as loaded: not the float model's, not the Q4_0 file's
    assert fingerprint == base_model.fingerprint(model, None)
    assert fingerprint not in (
        base_model.fingerprint(checkpoints["Q4_0"][0], None),
        model_fingerprint(tiny_llama.model_dir),
    )
    capsys.readouterr()
    assert main(["audit", "show", request_id, "--url", url]) == 0
    assert "quantization  gguf 4-bit g32 asym Q4_1" in capsys.readouterr().out
    assert main(["audit", "instances", "--url", url, "--format", "jsonl"]) == 0
    (instance,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert (instance["quant_method"], instance["quant_bits"]) == ("gguf", 4)
    with AuditLog(url) as log:
        manifest = write_report(log, tmp_path / "bundle", since="2000-01-01", until="2100-01-01", fmt="jsonl",
                                unsigned=True, progress=False)  # fmt: skip
        assert [m["quantization"] for m in manifest["sources"]["instances"]] == ["gguf 4-bit g32 asym Q4_1"]
        assert log.verify().ok
    # an instance row whose quantization is rewritten no longer matches its instance_registered event
    from tests.audit.tampering import tamper

    tamper(url, "UPDATE instances SET quantization = 'compressed-tensors 8-bit per-channel sym'")
    with AuditLog(url) as log:
        assert not log.verify().ok


def test_bitsandbytes_on_a_float_checkpoint_quantizes_it_at_load_on_record(tiny_llama, tmp_path):
    """quantization="bitsandbytes" on a float checkpoint: nf4 at load, as bitsandbytes quantizes (blocks of 64,
    nearest of the 16 levels); the same greedy ids as transformers + PEFT on those nf4 weights; the record names it
    and the float checkpoint it came from."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from sqlalchemy import text

    from loraledger.audit import AuditLog
    from loraledger.gpu.weights import model_fingerprint
    from tests.quantization.quantized_checkpoints import PROJECTIONS, nf4

    reference = tmp_path / "nf4-float"
    shutil.copytree(tiny_llama.model_dir, reference)
    weights = load_file(str(tiny_llama.model_dir / "model.safetensors"))
    for key, w in weights.items():
        if key.removesuffix(".weight").endswith(PROJECTIONS):
            weights[key] = nf4(w.float(), nested=False)[1]
    save_file(weights, str(reference / "model.safetensors"))
    loras, names, prompts = _batch(tiny_llama)
    ref = hf_reference_generate(reference, tiny_llama.adapters, prompts, names, MAX_NEW)
    ours = _engine(tiny_llama.model_dir, tiny_llama.model_dir, "float32", tiny_llama, prompts, names, loras,
                   quantization="bitsandbytes")  # fmt: skip
    assert ours == ref.token_ids
    assert json.loads((tiny_llama.model_dir / "config.json").read_text()).get("quantization_config") is None

    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    with LLM(model=str(tiny_llama.model_dir), device="cpu", quantization="bitsandbytes", audit_url=url) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=2))
    with AuditLog(url) as log, log.snapshot() as conn:
        row = conn.execute(text("SELECT quantization, quant_source_fingerprint FROM instances")).one()
        served = conn.execute(text("SELECT base_model_fingerprint FROM requests")).scalar_one()
        assert log.verify().ok
    assert row.quantization == "bitsandbytes 4-bit g64 sym nf4 quantized at load"
    assert row.quant_source_fingerprint == model_fingerprint(tiny_llama.model_dir) != served


def test_serve_takes_a_gguf_file_its_tokenizer_and_quantization(checkpoints, tiny_llama, tmp_path):
    from loraledger.cli import build_parser
    from loraledger.errors import ConfigError
    from loraledger.server.serve_cli import config_from_args

    gguf = checkpoints["Q4_0"][0]
    argv = ["serve", str(gguf), "--tokenizer", str(tiny_llama.model_dir), "--quantization", "gguf",
            "--insecure-no-auth", "--audit-url", f"sqlite:///{tmp_path / 'a.db'}"]  # fmt: skip
    args = config_from_args(build_parser().parse_args(argv)).engine_args
    assert (args.model, args.tokenizer, args.quantization) == (str(gguf), str(tiny_llama.model_dir), "gguf")
    with pytest.raises(QuantizationError, match="supported"):
        config_from_args(build_parser().parse_args([*argv[:4], "--quantization", "fp8", *argv[6:]]))
    # a GGUF model names its tokenizer: the file holds none the engine reads
    with pytest.raises(ConfigError, match="tokenizer="):
        LLM(model=str(gguf), device="cpu", audit_url=None)
