"""Loading adapters over HTTP when the audit store fails half-way: the failed load leaves no id or name behind, so
later loads (of any adapter, and of the same one again) succeed."""

from __future__ import annotations

import shutil

import httpx

from loraledger.errors import AuditUnavailableError
from tests.server.conftest import server_config
from tests.server.live import LiveServer


def test_a_load_whose_record_times_out_leaves_nothing_registered(tiny_llama_chat, keys, tmp_path):
    with LiveServer(server_config(tiny_llama_chat, tmp_path, keys)) as server:
        engine = server.state.engine
        real = engine._append_and_wait
        failures = [AuditUnavailableError("the audit store did not answer within 5 s")]

        async def flaky(*args, **kwargs):
            if failures:
                raise failures.pop()
            return await real(*args, **kwargs)

        engine._append_and_wait = flaky
        admin = {"Authorization": f"Bearer {keys.admin}"}
        url = f"{server.base_url}/v1/load_lora_adapter"
        first = {"lora_name": "ogd", "lora_path": str(tiny_llama_chat.adapters["ogd_r16_rslora"])}
        r = httpx.post(url, json=first, headers=admin, timeout=60)
        assert r.status_code == 503, r.text
        other = shutil.copytree(tiny_llama_chat.adapters["qv_r4"], tmp_path / "qv-copy")
        r = httpx.post(url, json={"lora_name": "qv_copy", "lora_path": str(other)}, headers=admin, timeout=60)
        assert r.status_code == 200, r.text  # not 400 "already registered"
        r = httpx.post(url, json=first, headers=admin, timeout=60)
        assert r.status_code == 200, r.text  # the failed one loads on retry
        models = httpx.get(f"{server.base_url}/v1/models", headers=admin, timeout=10).json()["data"]
        assert {"ogd", "qv_copy"} <= {m["id"] for m in models}
