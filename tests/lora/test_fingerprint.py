"""The adapter fingerprint: the documented algorithm written again from its text, a golden value, what changes it."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from loraledger.lora.checkpoint_reader import fingerprint_adapter
from tests.lora.adapter_folders import copy_folder, load_adapter


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


# ---- fingerprint -----------------------------------------------------------------------------


def test_fingerprint_follows_the_documented_algorithm_and_is_stable(adapter, model_config, tmp_path):
    folder = adapter[0]
    first, second = load_adapter(folder, model_config), load_adapter(folder, model_config)
    assert first.fingerprint == second.fingerprint == fingerprint_adapter(str(folder)) == _reference_fingerprint(folder)
    assert len(first.fingerprint) == 64
    assert fingerprint_adapter(str(copy_folder(folder, tmp_path / "copy"))) == first.fingerprint


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
    folder = copy_folder(adapter[0], tmp_path / "reformatted")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(dict(reversed(cfg.items())), indent=4))
    assert fingerprint_adapter(str(folder)) == base

    cfg["lora_alpha"] = 9
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    assert fingerprint_adapter(str(folder)) != base


def test_fingerprint_changes_with_one_tensor_byte(adapter, tmp_path):
    folder = copy_folder(adapter[0], tmp_path / "flipped")
    path = folder / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte always belongs to some tensor's data
    path.write_bytes(bytes(data))
    assert fingerprint_adapter(str(folder)) != fingerprint_adapter(str(adapter[0]))
