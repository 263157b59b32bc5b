"""Fixtures of the lora tests: the tiny base model's config and one plain adapter, once per test module."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraledger.gpu.model_config import ModelConfig
from tests.lora.adapter_folders import save_adapter, tiny_model


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> ModelConfig:
    folder = tmp_path_factory.mktemp("base")
    tiny_model().save_pretrained(str(folder))
    return ModelConfig.from_pretrained(folder)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> tuple[Path, dict]:
    return save_adapter(tmp_path_factory.mktemp("adapters") / "plain")
