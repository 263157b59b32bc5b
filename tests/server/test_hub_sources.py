"""The server with Hub repo ids: `loraledger serve org/model --lora-modules name=org/repo` and POST
/v1/load_lora_adapter with `org/repo[@revision]`, against tests/fake_hub.py; what the Hub refuses maps to its status."""

from __future__ import annotations

import dataclasses
import threading

import httpx
import msgspec
from sqlalchemy import select

from loraledger.cli import build_parser
from loraledger.server.serve_cli import config_from_args
from loraledger.store.audit_store import ADAPTERS, AuditStore
from tests.server.conftest import make_keys
from tests.server.live import LiveServer


def _adapters(url: str) -> dict[str, tuple]:
    with AuditStore(url) as store, store.engine.connect() as conn:
        rows = conn.execute(select(ADAPTERS)).all()
    return {r.name: (r.fingerprint, r.repo_id, r.revision, r.commit_sha) for r in rows}


def test_serve_loads_the_model_and_adapters_from_the_hub(fake_hub, tiny_llama, tmp_path):
    model_sha = fake_hub.push("org/tiny", tiny_llama.model_dir)
    qv_sha = fake_hub.push("org/qv", tiny_llama.adapters["qv_r4"])
    r8_v1 = fake_hub.push("org/r8", tiny_llama.adapters["all_r8"], branch="v1")
    fake_hub.push("org/slow", tiny_llama.adapters["ogd_r16_rslora"], hang=True)
    audit_url = f"sqlite:///{tmp_path / 'audit.db'}"
    argv = ["serve", "org/tiny", "--served-model-name", "tiny", "--lora-modules", "qv=org/qv", "--max-loras", "2",
            "--max-lora-rank", "16", "--block-size", "4", "--audit-url", audit_url]  # fmt: skip
    keys = make_keys(tmp_path / "keys.toml")
    config = config_from_args(build_parser().parse_args([*argv, "--api-keys", str(keys.file)]))
    assert config.engine_args.model == "org/tiny"
    # the hung repo's load gives up after 2 s, not lora_download_timeout's default
    config = dataclasses.replace(
        config, engine_args=msgspec.structs.replace(config.engine_args, lora_download_timeout=2.0)
    )
    admin = {"Authorization": f"Bearer {keys.admin}"}
    with LiveServer(config) as server:
        url = server.base_url
        models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", headers=admin).json()["data"]}
        assert models["tiny"]["root"] == "org/tiny" and models["qv"]["root"] == "org/qv"
        assert _adapters(audit_url)["qv"][1:] == ("org/qv", "main", qv_sha)

        body = {"lora_name": "r8", "lora_path": "org/r8@v1"}
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=admin, timeout=60)
        assert r.status_code == 200, r.text
        fp, repo, revision, commit = _adapters(audit_url)["r8"]
        assert (repo, revision, commit) == ("org/r8", "v1", r8_v1)
        r = httpx.post(
            f"{url}/v1/completions", json={"model": "r8", "prompt": "hi", "max_tokens": 2}, headers=admin, timeout=60
        )
        assert r.status_code == 200 and r.json()["system_fingerprint"] == fp

        for path, status, code in (("org/missing", 404, "hub_not_found"), ("org/r8@nope", 404, "hub_not_found")):
            r = httpx.post(
                f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}, headers=admin, timeout=60
            )
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text

        # a hung Hub holds only the request for its adapter: the base model answers meanwhile
        answers: dict[str, httpx.Response] = {}
        slow = threading.Thread(
            target=lambda: answers.setdefault(
                "slow",
                httpx.post(
                    f"{url}/v1/load_lora_adapter",
                    json={"lora_name": "slow", "lora_path": "org/slow"},
                    headers=admin,
                    timeout=60,
                ),
            )
        )
        slow.start()
        r = httpx.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, headers=admin, timeout=30
        )
        assert r.status_code == 200
        slow.join(60)
        assert answers["slow"].status_code == 503 and answers["slow"].json()["error"]["code"] == "hub_timeout"

    with AuditStore(audit_url) as store, store.engine.connect() as conn:
        (instance,) = conn.execute(select(store_instances())).all()
    assert (instance.model_repo_id, instance.model_commit_sha) == ("org/tiny", model_sha)


def store_instances():
    from loraledger.store.models import Instance

    return Instance.__table__
