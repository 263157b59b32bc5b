"""Tests for loraledger/lora/checkpoint_reader.py: real PEFT adapters on a tiny Llama, the fingerprint, every typed error."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import time
from pathlib import Path

import peft
import pytest
import torch
import transformers

from loraledger.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterRankError,
    AdapterShapeError,
    AdapterTargetError,
    AdapterUnsupportedError,
)
from loraledger.gpu.config import ModelConfig
from loraledger.lora.checkpoint_reader import fingerprint_adapter, load_lora_checkpoint

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)


def _tiny_model(**overrides):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))


def _save_adapter(folder: Path, model_overrides: dict | None = None, **lora_kwargs) -> tuple[Path, dict]:
    """Save a random (non-zero B) PEFT LoRA adapter; returns its folder and peft's own state dict."""
    lora_kwargs.setdefault("target_modules", ["q_proj", "v_proj", "down_proj"])
    config = peft.LoraConfig(
        r=lora_kwargs.pop("r", 4), lora_alpha=lora_kwargs.pop("lora_alpha", 8), init_lora_weights=False, **lora_kwargs
    )
    model = peft.get_peft_model(_tiny_model(**(model_overrides or {})), config)
    model.save_pretrained(str(folder))
    return folder, peft.get_peft_model_state_dict(model)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> ModelConfig:
    folder = tmp_path_factory.mktemp("base")
    _tiny_model().save_pretrained(str(folder))
    return ModelConfig.from_pretrained(folder)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> tuple[Path, dict]:
    return _save_adapter(tmp_path_factory.mktemp("adapters") / "plain")


def _load(path, model_config, max_lora_rank=16):
    return load_lora_checkpoint(
        str(path), lora_name="ad", lora_int_id=1, model_config=model_config, max_lora_rank=max_lora_rank
    )


def _reference_fingerprint(folder: Path) -> str:
    """The module docstring's algorithm, written again from the text alone."""

    def frame(b: bytes) -> bytes:
        return struct.pack(">Q", len(b)) + b

    config = json.loads((folder / "adapter_config.json").read_text())
    raw = (folder / "adapter_model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    out = frame(b"loraledger-adapter-fingerprint/v1")
    out += frame(json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
    for name in sorted(k for k in header if k != "__metadata__"):
        e = header[name]
        begin, end = e["data_offsets"]
        out += (
            frame(name.encode()) + frame(e["dtype"].encode()) + frame(json.dumps(e["shape"]).replace(" ", "").encode())
        )
        out += frame(body[begin:end])
    return hashlib.sha256(out).hexdigest()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- loading ---------------------------------------------------------------------------------


def test_weights_equal_peft_state_dict(adapter, model_config):
    folder, state = adapter
    ckpt = _load(folder, model_config)
    assert ckpt.target_modules == ("q_proj", "v_proj", "down_proj")
    assert set(ckpt.weights) == {(layer, m) for layer in range(2) for m in ckpt.target_modules}
    for (layer, module), (a, b) in ckpt.weights.items():
        block = "mlp" if module == "down_proj" else "self_attn"
        prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
        assert a.dtype == b.dtype == torch.float32 and a.is_contiguous()
        torch.testing.assert_close(a, state[f"{prefix}.lora_A.weight"], rtol=0, atol=0)
        torch.testing.assert_close(b, state[f"{prefix}.lora_B.weight"], rtol=0, atol=0)
        assert a.shape[0] == b.shape[1] == 4
    # slot-ready stacks are built while loading: q/k/v and down targeted, o and gate/up absent
    stacks = ckpt.slot_stacks
    assert set(stacks.groups) == {"qkv", "down"}
    a_qkv, b_qkv = stacks.groups["qkv"]
    r, q = stacks.rank, model_config.q_size
    torch.testing.assert_close(a_qkv[1, :4], ckpt.weights[(1, "q_proj")][0], rtol=0, atol=0)
    assert not a_qkv[:, 4:r].any() and not a_qkv[:, r : 2 * r].any()  # rank padding; k_proj untargeted
    torch.testing.assert_close(b_qkv[0, :q, :4], ckpt.weights[(0, "q_proj")][1], rtol=0, atol=0)  # unscaled:
    assert stacks.scale == ckpt.scale  # LoraSlots.load applies it
    # the tensors are held once: the weights are views into the stacks, and nbytes counts the stacks alone
    stack_storages = {t.untyped_storage().data_ptr() for pair in stacks.groups.values() for t in pair}
    assert all(t.untyped_storage().data_ptr() in stack_storages for pair in ckpt.weights.values() for t in pair)
    assert ckpt.nbytes == sum(a.nbytes + b.nbytes for a, b in stacks.groups.values())
    record = ckpt.to_record("base-fp", 12.5)
    assert (record.fingerprint, record.rank, record.alpha, record.target_modules, record.first_seen) == (
        ckpt.fingerprint,
        4,
        8.0,
        ["q_proj", "v_proj", "down_proj"],
        12.5,
    )


def test_slots_get_each_b_times_the_scale_rounded_once_from_the_views(model_config, tmp_path):
    from loraledger.lora.device_slots import LoraSlots

    # r=4 below max_lora_rank=8, so the B views are strided; scale 7/4 rounds in bf16
    folder, state = _save_adapter(tmp_path / "a7", lora_alpha=7)
    ckpt = _load(folder, model_config, max_lora_rank=8)
    _, b = ckpt.weights[(1, "v_proj")]
    assert not b.is_contiguous() and ckpt.scale == 7 / 4
    torch.testing.assert_close(
        b, state["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"], rtol=0, atol=0
    )
    for dtype in (torch.bfloat16, torch.float32):
        slots = LoraSlots(model_config, max_loras=2, max_lora_rank=8, dtype=dtype, device="cpu")
        slots.load(1, ckpt)
        _, b_slot, offsets = slots.layer(1, "qkv")
        assert torch.equal(b_slot[1, offsets[2] : offsets[3], :4], (b * ckpt.scale).to(dtype))
        assert b_slot[1, :, 4:].count_nonzero() == 0


def test_scale_plain_and_rslora(adapter, model_config, tmp_path):
    assert _load(adapter[0], model_config).scale == pytest.approx(8 / 4)
    folder, _ = _save_adapter(tmp_path / "rs", r=8, lora_alpha=16, use_rslora=True)
    ckpt = _load(folder, model_config)
    assert ckpt.use_rslora and ckpt.scale == pytest.approx(16 / math.sqrt(8))


def test_half_precision_tensors_become_fp32(adapter, model_config, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(adapter[0], tmp_path / "bf16")
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(folder / "adapter_model.safetensors").items()}
    save_file(tensors, folder / "adapter_model.safetensors")
    ckpt = _load(folder, model_config)
    a, _ = ckpt.weights[(0, "q_proj")]
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].float())


def test_adapter_name_segment_and_regex_and_all_linear_targets(adapter, model_config, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(adapter[0], tmp_path / "named")
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file(
        {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}, folder / "adapter_model.safetensors"
    )
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["target_modules"] = r"model\.layers\.\d+\.(self_attn\.(q|v)_proj|mlp\.down_proj)"
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    assert _load(folder, model_config).target_modules == ("q_proj", "v_proj", "down_proj")

    all_linear, _ = _save_adapter(tmp_path / "all", target_modules="all-linear")
    ckpt = _load(all_linear, model_config)
    assert ckpt.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_loads_concurrently_in_worker_threads(adapter, model_config):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        ckpts = list(pool.map(lambda _: _load(adapter[0], model_config), range(4)))
    assert len({c.fingerprint for c in ckpts}) == 1
    for c in ckpts[1:]:
        assert all(torch.equal(c.weights[k][1], ckpts[0].weights[k][1]) for k in c.weights)


# ---- fingerprint -----------------------------------------------------------------------------


def test_fingerprint_follows_the_documented_algorithm_and_is_stable(adapter, model_config, tmp_path):
    folder = adapter[0]
    first, second = _load(folder, model_config), _load(folder, model_config)
    assert first.fingerprint == second.fingerprint == fingerprint_adapter(str(folder)) == _reference_fingerprint(folder)
    assert len(first.fingerprint) == 64
    assert fingerprint_adapter(str(_copy(folder, tmp_path / "copy"))) == first.fingerprint


def test_fingerprint_golden_value(tmp_path):
    # a fixed adapter written by hand: pins the algorithm across processes, machines and library versions
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 2, "target_modules": ["q_proj"]}')
    save_file(
        {"b": torch.tensor([[1.0]], dtype=torch.float16), "a": torch.arange(2, dtype=torch.float32).reshape(1, 2)},
        tmp_path / "adapter_model.safetensors",
        metadata={"format": "pt"},
    )

    def frame(b: bytes) -> bytes:
        return struct.pack(">Q", len(b)) + b

    by_hand = (
        frame(b"loraledger-adapter-fingerprint/v1")
        + frame(b'{"lora_alpha":2,"r":1,"target_modules":["q_proj"]}')
        + frame(b"a")
        + frame(b"F32")
        + frame(b"[1,2]")
        + frame(struct.pack("<2f", 0.0, 1.0))
        + frame(b"b")
        + frame(b"F16")
        + frame(b"[1,1]")
        + frame(bytes.fromhex("003c"))
    )
    expected = "a572e2098a67258a5fbbfe71a9c1fc8f2b8a3ac9a4012b5af6d42e8fea7ab4f4"
    assert hashlib.sha256(by_hand).hexdigest() == expected
    assert fingerprint_adapter(str(tmp_path)) == expected == _reference_fingerprint(tmp_path)


def test_fingerprint_ignores_formatting_but_not_values(adapter, tmp_path):
    base = fingerprint_adapter(str(adapter[0]))
    folder = _copy(adapter[0], tmp_path / "reformatted")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(dict(reversed(cfg.items())), indent=4))
    assert fingerprint_adapter(str(folder)) == base

    cfg["lora_alpha"] = 9
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    assert fingerprint_adapter(str(folder)) != base


def test_fingerprint_changes_with_one_tensor_byte(adapter, tmp_path):
    folder = _copy(adapter[0], tmp_path / "flipped")
    path = folder / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte always belongs to some tensor's data
    path.write_bytes(bytes(data))
    assert fingerprint_adapter(str(folder)) != fingerprint_adapter(str(adapter[0]))


# ---- errors ----------------------------------------------------------------------------------


def _raises(cls, folder, model_config, *words, max_lora_rank=16):
    with pytest.raises(cls) as info:
        _load(folder, model_config, max_lora_rank)
    message = str(info.value)
    assert info.value.lora_name == "ad" and info.value.lora_path == str(folder)
    for word in words:
        assert word in message, message
    return message


def test_missing_files(adapter, model_config, tmp_path):
    _raises(AdapterNotFoundError, tmp_path / "nowhere", model_config, "does not exist")
    (tmp_path / "file").write_text("x")
    _raises(AdapterNotFoundError, tmp_path / "file", model_config, "not a directory")
    no_config = _copy(adapter[0], tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    _raises(AdapterNotFoundError, no_config, model_config, "adapter_config.json is missing")
    no_weights = _copy(adapter[0], tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    _raises(AdapterNotFoundError, no_weights, model_config, "adapter_model.safetensors is missing")
    (no_weights / "adapter_model.bin").write_bytes(b"pickle")
    _raises(AdapterNotFoundError, no_weights, model_config, "only adapter_model.safetensors is supported", "save_file")
    with pytest.raises(AdapterNotFoundError):
        fingerprint_adapter(str(tmp_path / "nowhere"))


def test_corrupt_files(adapter, model_config, tmp_path):
    truncated = _copy(adapter[0], tmp_path / "truncated")
    path = truncated / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    _raises(AdapterFormatError, truncated, model_config, "corrupt or truncated")
    path.write_bytes(path.read_bytes()[:5])
    _raises(AdapterFormatError, truncated, model_config, "corrupt or truncated")
    with pytest.raises(AdapterFormatError):
        fingerprint_adapter(str(truncated))

    bad_json = _copy(adapter[0], tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{not json")
    _raises(AdapterFormatError, bad_json, model_config, "not valid JSON")


def _with_one_value(tmp_path: Path, pick, value: float) -> tuple[Path, str]:
    """A fresh adapter whose tensor `pick(sorted names)` has `value` at [0, 0]; its folder and that name."""
    folder = _save_adapter(tmp_path / "edited")[0]
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = pick(sorted(tensors))
    tensors[name][0, 0] = value
    save_file(tensors, str(path))
    return folder, name


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(model_config, tmp_path, value):
    folder, name = _with_one_value(tmp_path, lambda names: names[1], value)
    _raises(AdapterFormatError, folder, model_config, repr(name), "NaN or infinite", "re-train or re-export")


def test_scaled_b_overflowing_fp32_is_refused(model_config, tmp_path):
    # lora_alpha 8 / r 4: B is doubled in the slots, so 3e38 (finite in fp32) becomes 6e38
    folder, _ = _with_one_value(tmp_path, lambda names: next(n for n in names if "lora_B" in n), 3e38)
    _raises(AdapterFormatError, folder, model_config, "overflows fp32")


def test_wrong_shapes_for_another_base_model(model_config, tmp_path):
    folder, _ = _save_adapter(tmp_path / "wide", model_overrides={"hidden_size": 48})
    _raises(AdapterShapeError, folder, model_config, "different base model")
    deep, _ = _save_adapter(tmp_path / "deep", model_overrides={"num_hidden_layers": 3})
    _raises(AdapterShapeError, deep, model_config, "layer 2")


def test_missing_half_of_a_pair(adapter, model_config, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(adapter[0], tmp_path / "half")
    tensors = load_file(folder / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    save_file(tensors, folder / "adapter_model.safetensors")
    _raises(AdapterShapeError, folder, model_config, "no lora_B")


@pytest.mark.parametrize(
    ("lora_kwargs", "words"),
    [
        ({"use_dora": True}, ("DoRA", "not supported yet")),
        ({"modules_to_save": ["lm_head"]}, ("modules_to_save", "not supported yet")),
        ({"bias": "lora_only"}, ("bias='lora_only'", "not supported yet")),
    ],
)
def test_unsupported_features(lora_kwargs, words, model_config, tmp_path):
    folder, _ = _save_adapter(tmp_path / "unsupported", **lora_kwargs)
    _raises(AdapterUnsupportedError, folder, model_config, *words)


def test_unsupported_targets(model_config, tmp_path):
    lm_head, _ = _save_adapter(tmp_path / "lm_head", target_modules=["q_proj", "lm_head"])
    _raises(AdapterTargetError, lm_head, model_config, "lm_head", "supported targets")
    embed, _ = _save_adapter(tmp_path / "embed", target_modules=["embed_tokens"])
    _raises(AdapterTargetError, embed, model_config, "embed_tokens")
    foreign = _copy(lm_head, tmp_path / "foreign")
    cfg = json.loads((foreign / "adapter_config.json").read_text())
    cfg["target_modules"] = ["c_attn"]
    (foreign / "adapter_config.json").write_text(json.dumps(cfg))
    _raises(AdapterTargetError, foreign, model_config, "matches no module")
    # the tensor names are checked too, whatever the config says
    cfg["target_modules"] = None
    (foreign / "adapter_config.json").write_text(json.dumps(cfg))
    _raises(AdapterTargetError, foreign, model_config, "base_model.model.lm_head")


def test_rank_above_max_lora_rank(model_config, tmp_path):
    folder, _ = _save_adapter(tmp_path / "r32", r=32, lora_alpha=32)
    _raises(AdapterRankError, folder, model_config, "r=32", "max_lora_rank to at least 32", max_lora_rank=16)
    assert _load(folder, model_config, max_lora_rank=32).rank == 32


def test_config_and_tensors_must_agree(adapter, model_config, tmp_path):
    folder = _copy(adapter[0], tmp_path / "disagree")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "k_proj", "v_proj", "down_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    _raises(AdapterShapeError, folder, model_config, "model.layers.0.self_attn.k_proj", "incomplete")
    cfg["target_modules"] = ["q_proj", "down_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    _raises(AdapterFormatError, folder, model_config, "model.layers.0.self_attn.v_proj", "does not declare")


# ---- nothing is read whole before it is checked ------------------------------------------------


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _rewrite(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def test_a_64_gib_sparse_weights_file_is_refused_from_its_header(adapter, model_config, tmp_path):
    """`truncate -s 64G` on a real adapter: its header is fine, the file is not; refused without reading it."""
    folder = _copy(adapter[0], tmp_path / "sparse")
    os.truncate(folder / "adapter_model.safetensors", 64 << 30)
    before = _resident_mib()
    started = time.perf_counter()
    _raises(AdapterFormatError, folder, model_config, "after the last tensor", "68719476736 bytes")
    with pytest.raises(AdapterFormatError):
        fingerprint_adapter(str(folder))
    assert time.perf_counter() - started < 5  # upper bound for a loaded machine; it reads a few kB
    assert _resident_mib() - before < 64


def test_a_header_declaring_huge_tensors_is_refused_before_they_are_read(adapter, model_config, tmp_path):
    """A well-formed file whose tensors are 8 GiB (sparse): the shapes fail against the base model first."""
    folder = _copy(adapter[0], tmp_path / "huge")
    path = folder / "adapter_model.safetensors"
    header, _ = _header(path)
    name = sorted(k for k in header if k.endswith("q_proj.lora_A.weight"))[0]
    begin = 0
    for key in sorted(k for k in header if k != "__metadata__"):
        shape = [4, 1 << 29] if key == name else header[key]["shape"]
        size = 4 * math.prod(shape)
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + size]}
        begin += size
    _rewrite(path, header, b"")
    os.truncate(path, path.stat().st_size + begin)  # exactly the declared data section, all holes
    before = _resident_mib()
    _raises(
        AdapterShapeError,
        folder,
        model_config,
        name.split(".lora_A")[0].split("model.layers.")[1].split(".")[0],
        "[4, 536870912]",
    )
    assert _resident_mib() - before < 64


@pytest.mark.parametrize("damage", ["gap", "overlap", "trailing"])
def test_the_data_section_must_be_exactly_the_tensors(adapter, model_config, tmp_path, damage):
    folder = _copy(adapter[0], tmp_path / damage)
    path = folder / "adapter_model.safetensors"
    header, data = _header(path)
    names = sorted(k for k in header if k != "__metadata__")
    if damage == "gap":
        for key in names:
            begin, end = header[key]["data_offsets"]
            header[key]["data_offsets"] = [begin + 4, end + 4]
        data = b"\0" * 4 + data
    elif damage == "overlap":
        header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])
    else:
        data += b"\0" * 4
    _rewrite(path, header, data)
    _raises(AdapterFormatError, folder, model_config, "corrupt")


def test_an_oversized_config_is_refused_before_it_is_read(adapter, model_config, tmp_path):
    folder = _copy(adapter[0], tmp_path / "big-config")
    with open(folder / "adapter_config.json", "ab") as f:
        f.truncate(8 << 30)  # sparse
    _raises(AdapterFormatError, folder, model_config, "larger than")


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("rank_pattern", {"q_proj": 0}, ("rank_pattern must map module names to positive integer ranks",)),
        ("rank_pattern", ["q_proj"], ("rank_pattern must map",)),
        ("alpha_pattern", {"q_proj": float("inf")}, ("alpha_pattern must map module names to finite numbers",)),
        ("alpha_pattern", {"q_proj(": 2}, ("is not a valid regex",)),
        ("layers_to_transform", "0", ("layers_to_transform='0'",)),
        ("layers_pattern", 3, ("layers_pattern=3",)),
    ],
)
def test_malformed_per_module_options_are_refused(adapter, model_config, tmp_path, key, value, words):
    folder = _copy(adapter[0], tmp_path / "bad-options")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg[key] = value
    if key == "layers_pattern":
        cfg["layers_to_transform"] = [0]
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    _raises(AdapterFormatError, folder, model_config, *words)


def test_a_rank_pattern_above_max_lora_rank_is_refused_at_its_module(model_config, tmp_path):
    folder, _ = _save_adapter(tmp_path / "pattern32", r=4, lora_alpha=8, rank_pattern={"q_proj": 32})
    _raises(
        AdapterRankError, folder, model_config, "q_proj has rank 32", "max_lora_rank to at least 32", max_lora_rank=16
    )
    assert _load(folder, model_config, max_lora_rank=32).slot_rank == 32
