"""A live server over the tiny fixture (chat template included) with a keys file, shared per module; keys by role."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from loraledger import EngineArgs
from loraledger.server import LoRAModule, ServerConfig
from loraledger.server.auth import add_key
from tests.server.live import LiveServer

BASE = "tiny"  # the base model's served name


@dataclass
class Keys:
    admin: str  # role admin, every model
    acme: str  # tenant acme: the base model and qv_r4
    globex: str  # tenant globex: every adapter whose name ends in _r8, not the base model
    limited: str  # tenant slow: the base model, 2 requests per minute
    ids: dict[str, str]  # name above -> key id
    file: Path


def make_keys(path: Path) -> Keys:
    made = {
        "admin": add_key(path, tenant="ops", adapters=["*"], admin=True),
        "acme": add_key(path, tenant="acme", adapters=[BASE, "qv_r4"]),
        "globex": add_key(path, tenant="globex", adapters=["*_r8"]),
        "limited": add_key(path, tenant="slow", adapters=[BASE], rate_limit="2/minute"),
    }
    return Keys(
        **{name: key for name, (_, key) in made.items()},
        ids={name: key_id for name, (key_id, _) in made.items()},
        file=path,
    )


def server_config(tiny, tmp: Path, keys: Keys | None, **overrides) -> ServerConfig:
    args = dict(model=str(tiny.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, max_num_seqs=64,
                audit_url=f"sqlite:///{tmp / 'audit.db'}", seed=0)  # fmt: skip
    args.update(overrides.pop("engine", {}))
    return ServerConfig(
        engine_args=EngineArgs(**args),
        served_model_name=(BASE,),
        lora_modules=(
            LoRAModule("qv_r4", str(tiny.adapters["qv_r4"])),
            LoRAModule("all_r8", str(tiny.adapters["all_r8"])),
        ),
        api_keys_file=str(keys.file) if keys is not None else None,
        **overrides,
    )


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("keys") / "keys.toml")


@pytest.fixture(scope="module")
def live(tiny_llama_chat, keys, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    with LiveServer(server_config(tiny_llama_chat, tmp, keys)) as server:
        server.audit_url = f"sqlite:///{tmp / 'audit.db'}"
        server.scrape_key = keys.admin
        server.tiny = tiny_llama_chat
        yield server


@pytest.fixture
def client(live, keys):
    """An openai client with acme's key."""
    import openai

    with openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=keys.acme, max_retries=0, timeout=60) as c:
        yield c


def openai_client(live, key: str):
    import openai

    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0, timeout=60)
