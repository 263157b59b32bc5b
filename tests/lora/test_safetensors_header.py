"""The safetensors header is checked before any tensor byte is read: corrupt, sparse, huge and holed files."""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path

import pytest

from loraledger.errors import (
    AdapterFormatError,
    AdapterShapeError,
)
from loraledger.lora.checkpoint_reader import fingerprint_adapter
from tests.lora.adapter_folders import copy_folder, raises_for


def test_corrupt_files(adapter, model_config, tmp_path):
    truncated = copy_folder(adapter[0], tmp_path / "truncated")
    path = truncated / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    raises_for(AdapterFormatError, truncated, model_config, "corrupt or truncated")
    path.write_bytes(path.read_bytes()[:5])
    raises_for(AdapterFormatError, truncated, model_config, "corrupt or truncated")
    with pytest.raises(AdapterFormatError):
        fingerprint_adapter(str(truncated))

    bad_json = copy_folder(adapter[0], tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{not json")
    raises_for(AdapterFormatError, bad_json, model_config, "not valid JSON")


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
    folder = copy_folder(adapter[0], tmp_path / "sparse")
    os.truncate(folder / "adapter_model.safetensors", 64 << 30)
    before = _resident_mib()
    started = time.perf_counter()
    raises_for(AdapterFormatError, folder, model_config, "after the last tensor", "68719476736 bytes")
    with pytest.raises(AdapterFormatError):
        fingerprint_adapter(str(folder))
    assert time.perf_counter() - started < 5  # upper bound for a loaded machine; it reads a few kB
    assert _resident_mib() - before < 64


def test_a_header_declaring_huge_tensors_is_refused_before_they_are_read(adapter, model_config, tmp_path):
    """A well-formed file whose tensors are 8 GiB (sparse): the shapes fail against the base model first."""
    folder = copy_folder(adapter[0], tmp_path / "huge")
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
    raises_for(
        AdapterShapeError,
        folder,
        model_config,
        name.split(".lora_A")[0].split("model.layers.")[1].split(".")[0],
        "[4, 536870912]",
    )
    assert _resident_mib() - before < 64


@pytest.mark.parametrize("damage", ["gap", "overlap", "trailing"])
def test_the_data_section_must_be_exactly_the_tensors(adapter, model_config, tmp_path, damage):
    folder = copy_folder(adapter[0], tmp_path / damage)
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
    raises_for(AdapterFormatError, folder, model_config, "corrupt")


def test_an_oversized_config_is_refused_before_it_is_read(adapter, model_config, tmp_path):
    folder = copy_folder(adapter[0], tmp_path / "big-config")
    with open(folder / "adapter_config.json", "ab") as f:
        f.truncate(8 << 30)  # sparse
    raises_for(AdapterFormatError, folder, model_config, "larger than")
