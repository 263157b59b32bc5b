"""An adapter unloaded serves no request admitted after the unload returned: requests racing the unload are either
admitted before it returns (and finish on the adapter) or refused with 404; none is bound to it afterwards."""

from __future__ import annotations

import asyncio
import time

import httpx
from sqlalchemy import select

from loraledger.store.audit_store import EVENTS, REQUESTS
from loraledger.store.records import EventKind
from tests.server.audit_rows import query
from tests.server.conftest import server_config
from tests.server.live import LiveServer

N_REQUESTS = 160


async def _race(base_url: str, key: str, admin: str) -> tuple[float, list[int]]:
    headers = {"Authorization": f"Bearer {key}"}
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:

        async def one(i: int) -> None:
            body = {"model": "racer", "max_tokens": 2, "temperature": 0, "stream": i % 2 == 0}
            if i % 3:  # a chat request renders its template off the event loop first: a wider window
                body["messages"] = [{"role": "user", "content": f"race {i} " * 8}]
                route = "/v1/chat/completions"
            else:
                body["prompt"] = f"race {i} " * 8
                route = "/v1/completions"
            r = await http.post(route, json=body, headers=headers)
            statuses.append(r.status_code)

        async def unload() -> float:
            await asyncio.sleep(0.5)  # requests are arriving and being admitted
            r = await http.post(
                "/v1/unload_lora_adapter", json={"lora_name": "racer"}, headers={"Authorization": f"Bearer {admin}"}
            )
            assert r.status_code == 200, r.text
            return time.time()

        async def stream_of_requests() -> None:
            tasks = []
            for i in range(N_REQUESTS):
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(0.004)  # spread over the unload
            await asyncio.gather(*tasks)

        returned, _ = await asyncio.gather(unload(), stream_of_requests())
    return returned, statuses


def test_no_request_is_admitted_on_an_adapter_after_its_unload_returned(tiny_llama_chat, keys, tmp_path):
    config = server_config(tiny_llama_chat, tmp_path, keys, max_pending_requests=4 * N_REQUESTS)
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    with LiveServer(config) as server:
        admin = {"Authorization": f"Bearer {keys.admin}"}
        path = str(tiny_llama_chat.adapters["qv_r4"])
        r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "racer", "lora_path": path},
                       headers=admin, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        returned, statuses = asyncio.run(_race(server.base_url, keys.admin, keys.admin))
        assert set(statuses) <= {200, 404}, sorted(set(statuses))
        assert statuses.count(200) and statuses.count(404), "the unload did not fall amid the requests"
    admitted = query(
        url,
        select(REQUESTS.c.request_id, EVENTS.c.at)
        .join(EVENTS, EVENTS.c.request_id == REQUESTS.c.request_id)
        .where(REQUESTS.c.lora_name == "racer", EVENTS.c.kind == EventKind.REQUEST_ADMITTED),
    )
    assert len(admitted) == statuses.count(200)
    late = [(rid, at.timestamp() - returned) for rid, at in admitted if at.timestamp() > returned]
    assert not late, f"{len(late)} of {len(admitted)} requests were admitted on the adapter after its unload returned"
