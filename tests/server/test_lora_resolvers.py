"""Adapters loaded on first use from `serve --lora-resolver DIR` and `--lora-resolver hf://ORG` (against
tests/fake_hub.py): only for keys allowed the name, once per name, on record as a load, within each resolver's limit."""

from __future__ import annotations

import hashlib
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import select

from loraledger import EngineArgs
from loraledger.cli import build_parser
from loraledger.errors import ConfigError
from loraledger.lora.checkpoint_reader import fingerprint_adapter
from loraledger.server import ServerConfig
from loraledger.server.auth import add_key
from loraledger.server.lora_resolvers import DEFAULT_MAX_LORAS, LoRAResolverSpec
from loraledger.server.serve_cli import config_from_args
from loraledger.store.audit_store import ADAPTERS, EVENTS, REQUESTS, AuditStore
from tests.api.test_chat import ADAPTER_TEMPLATE
from tests.server.live import LiveServer


def test_resolver_specs_and_the_names_they_take(tmp_path):
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "adapter_config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    folder = LoRAResolverSpec.parse(str(tmp_path))
    hub = LoRAResolverSpec.parse("hf://acme")
    assert (hub.location, hub.hub, str(hub)) == ("acme", True, "hf://acme")
    assert folder.path_for("sql") == str(tmp_path / "sql")
    for name in ("empty", "missing", "../sql", "..", ".", "a/b", "sql@v1", "", "x" * 200):
        assert folder.path_for(name) is None, name
    assert hub.path_for("sql") == "acme/sql" and hub.path_for("sql@v1") == "acme/sql@v1"
    for name in ("a/b", "..", "a--b", "sql@", "sql@has space", ""):
        assert hub.path_for(name) is None, name
    for bad in ("hf://", "hf://a/b", "hf://a--b", str(tmp_path / "nope"), ""):
        with pytest.raises(ConfigError, match="--lora-resolver"):
            LoRAResolverSpec.parse(bad)


def test_serve_flags(tmp_path, tiny_llama):
    argv = ["serve", str(tiny_llama.model_dir), "--lora-resolver", str(tmp_path), "--lora-resolver", "hf://acme"]
    config = config_from_args(build_parser().parse_args(argv))
    assert [str(s) for s in config.lora_resolvers] == [str(tmp_path), "hf://acme"]
    assert config.engine_args.enable_lora and config.lora_resolver_max_loras == DEFAULT_MAX_LORAS
    config = config_from_args(build_parser().parse_args([*argv, "--lora-resolver-max-loras", "3"]))
    assert config.lora_resolver_max_loras == 3
    with pytest.raises(ConfigError, match="max-loras"):
        config_from_args(build_parser().parse_args([*argv, "--lora-resolver-max-loras", "0"]))
    with pytest.raises(ConfigError, match="enable_lora"):
        ServerConfig(engine_args=EngineArgs(model=str(tiny_llama.model_dir)), lora_resolvers=(LoRAResolverSpec("x"),))


def _complete(url: str, key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    return httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _rows(url: str):
    with AuditStore(url) as store, store.engine.connect() as conn:
        adapters = {r.name: r for r in conn.execute(select(ADAPTERS)).all()}
        loaded = [r.payload["name"] for r in conn.execute(select(EVENTS)).all() if r.kind == "adapter_loaded"]
    return adapters, loaded


def test_adapters_load_on_first_use_for_allowed_keys_only(fake_hub, tiny_llama, tmp_path, monkeypatch):
    folder = tmp_path / "adapters"
    shutil.copytree(tiny_llama.adapters["qv_r4"], folder / "qv")
    shutil.copytree(tiny_llama.adapters["all_r8"], folder / "secret")
    fake_hub.push("org/r8", tiny_llama.adapters["all_r8"])
    v1 = fake_hub.push("org/r8", tiny_llama.adapters["ogd_r16_rslora"], branch="v1")
    for name in ("secret", "extra"):
        fake_hub.push(f"org/{name}", tiny_llama.adapters["qv_r4"])
    fake_hub.push("org/slow", tiny_llama.adapters["qv_r4"], hang=True)
    templated = {p.name: p.read_bytes() for p in tiny_llama.adapters["all_r8"].iterdir() if p.is_file()}
    fake_hub.push("org/chat", templated | {"chat_template.jinja": ADAPTER_TEMPLATE.encode()})
    keys = tmp_path / "keys.toml"
    _, admin = add_key(keys, tenant="ops", adapters=["*"], admin=True)
    _, user = add_key(keys, tenant="acme", adapters=["tiny", "qv", "r8*", "gone", "extra", "slow", "chat"])
    audit_url = f"sqlite:///{tmp_path / 'audit.db'}"
    engine = EngineArgs(model=str(tiny_llama.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16,
                        block_size=4, audit_url=audit_url, lora_download_timeout=5.0)  # fmt: skip
    config = ServerConfig(
        engine_args=engine,
        served_model_name=("tiny",),
        api_keys_file=str(keys),
        lora_resolvers=(LoRAResolverSpec.parse(str(folder)), LoRAResolverSpec.parse("hf://org")),
        lora_resolver_max_loras=3,
    )
    looked: list[str] = []
    path_for = LoRAResolverSpec.path_for
    monkeypatch.setattr(LoRAResolverSpec, "path_for", lambda self, name: looked.append(name) or path_for(self, name))

    with LiveServer(config) as server:
        url = server.base_url
        listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {user}"}).json()["data"]
        assert [m["id"] for m in listed] == ["tiny"]  # resolver adapters are listed once loaded, not before

        # a folder's adapter: loaded on first use, on record as a load, then listed
        r = _complete(url, user, "qv")
        assert r.status_code == 200, r.text
        assert r.json()["system_fingerprint"] == fingerprint_adapter(str(folder / "qv"))
        listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {user}"}).json()["data"]
        assert {m["id"]: m["root"] for m in listed} == {"tiny": str(tiny_llama.model_dir), "qv": str(folder / "qv")}

        # a name no resolver has: the usual 404 (a full resolver refuses any new name)
        r = _complete(url, user, "gone")
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")

        # a Hub adapter with its own chat template: the conversation is rendered with it, its digest on record
        chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {user}"}, timeout=60)
        assert r.status_code == 200, r.text
        chatted = r.json()["id"]

        # a hung Hub holds only the request for its adapter: the base model and an admin's load answer meanwhile
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(_complete, url, user, "slow")
            assert _complete(url, user, "tiny").status_code == 200
            body = {"lora_name": "side", "lora_path": str(tiny_llama.adapters["qv_r4"])}
            loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {admin}"})
            assert loaded.status_code == 200, loaded.text
            assert not slow.done()
            r = slow.result(timeout=60)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "hub_timeout"), r.text

        # a Hub organisation's: concurrent first requests search and download once
        asked = fake_hub.requests["info"]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: _complete(url, user, "r8"), range(4)))
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert {a.json()["system_fingerprint"] for a in answers} == {
            fingerprint_adapter(str(tiny_llama.adapters["all_r8"]))
        }
        assert fake_hub.requests["info"] == asked + 1
        r = _complete(url, user, "r8@v1")  # a pinned revision is a name of its own
        assert r.json()["system_fingerprint"] == fingerprint_adapter(str(tiny_llama.adapters["ogd_r16_rslora"]))

        # two loads of one name at once: the second is answered once the first is done (as if it came after), so
        # when it says the adapter exists, it is served
        def load_dup(_):
            auth = {"Authorization": f"Bearer {admin}"}
            body = {"lora_name": "dup", "lora_path": str(tiny_llama.adapters["all_r8"])}
            r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth, timeout=60)
            served = {m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth).json()["data"]}
            return r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None, "dup" in served

        with ThreadPoolExecutor(2) as pool:
            both = sorted(pool.map(load_dup, range(2)), key=lambda t: t[0])
        assert both == [(200, None, True), (400, "adapter_exists", True)]

        # a name the key may not use: 403, and no disk read nor Hub request, though both resolvers have it
        looked.clear()
        asked = fake_hub.requests.total()
        r = _complete(url, user, "secret")
        assert (r.status_code, r.json()["error"]["code"]) == (403, "model_not_permitted")
        assert looked == [] and fake_hub.requests.total() == asked

        # the Hub resolver has loaded its 3 (the hung one gave its place back): a fourth waits for an unload
        r = _complete(url, user, "extra")
        assert (r.status_code, r.json()["error"]["code"]) == (503, "resolver_full"), r.text
        unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "r8@v1"},
                            headers={"Authorization": f"Bearer {admin}"})  # fmt: skip
        assert unload.status_code == 200
        assert _complete(url, user, "extra").status_code == 200

    adapters, loaded = _rows(audit_url)
    assert (adapters["r8@v1"].repo_id, adapters["r8@v1"].revision, adapters["r8@v1"].commit_sha) == ("org/r8", "v1", v1)
    assert adapters["qv"].path == str(folder / "qv") and adapters["qv"].repo_id is None
    assert sorted(loaded) == [
        "chat",
        "dup",
        "extra",
        "qv",
        "r8",
        "r8@v1",
        "side",
    ]  # each loaded once; nothing for the denied or the unknown
    assert "secret" not in adapters and "gone" not in adapters and "slow" not in adapters
    with AuditStore(audit_url) as store, store.engine.connect() as conn:
        (digest,) = conn.execute(select(REQUESTS.c.chat_template_sha256).where(REQUESTS.c.request_id == chatted)).one()
    assert digest == hashlib.sha256(ADAPTER_TEMPLATE.encode()).hexdigest()
