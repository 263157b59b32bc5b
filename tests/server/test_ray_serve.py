"""The Ray Serve deployment on a local Ray instance (loopback, started and stopped here): two engine replicas on the tiny
fixture writing one PostgreSQL audit log, mixed-adapter traffic through the openai client. Greedy outputs equal one
engine's, every response is on record, and a replica killed with SIGKILL mid-load loses no released output."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray", reason="the Ray Serve deployment needs Ray: pip install 'loraledger[ray]'")

import httpx  # noqa: E402
import openai  # noqa: E402
from sqlalchemy import inspect as sa_inspect  # noqa: E402
from sqlalchemy import select  # noqa: E402

from loraledger import EngineArgs  # noqa: E402
from loraledger.audit import AuditLog  # noqa: E402
from loraledger.server import LoRAModule, ServerConfig  # noqa: E402
from loraledger.server.auth import add_key  # noqa: E402
from loraledger.store.audit_store import COMPLETIONS, REQUESTS  # noqa: E402
from loraledger.store.db import make_engine  # noqa: E402
from tests.server.audit_rows import completions_with_text, query  # noqa: E402
from tests.server.live import LiveServer  # noqa: E402
from tests.server.ray_cluster import RayServe  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(240)]

BASE = "tiny"
ADAPTERS = ("qv_r4", "all_r8", "ogd_r16_rslora")
MODELS = (*ADAPTERS, BASE)
# max_loras 1 and max_cpu_loras 2 below the 3 adapters: a replica cannot hold them all, so routing matters
ENGINE = dict(max_loras=1, max_cpu_loras=2, max_lora_rank=16, block_size=4, max_num_seqs=16, seed=0)
PROMPTS = [f"ticket {i}: the printer on floor {i} is" for i in range(8)]


def ask(client: openai.OpenAI, model: str, prompt: str, stream: bool, max_tokens: int = 6) -> tuple[str, str]:
    """(response id, text) of one greedy completion, streamed or not."""
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return r.id, r.choices[0].text
    rid, text, finished = None, "", False
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    ):
        rid = chunk.id
        text += "".join(c.text for c in chunk.choices)
        finished = finished or any(c.finish_reason for c in chunk.choices)
    if not finished:
        raise CutStream(f"the stream of {rid} ended before its last chunk")
    return rid, text


class CutStream(Exception):
    """A stream that ended without its final chunk: its output was never released whole."""


def instance_columns(url: str) -> dict[str, bool]:
    """Which audit tables carry an instance id (the rows of several engines say which engine wrote them)."""
    engine = make_engine(url)
    try:
        inspector = sa_inspect(engine)
        return {
            t: any(c["name"] == "instance_id" for c in inspector.get_columns(t))
            for t in ("requests", "completions", "events")
        }
    finally:
        engine.dispose()


def assert_on_record(url: str, answered: dict[str, str]) -> None:
    """Every response the client received is on record: its binding and its completion text, and with several
    engines on one log, the instance that served it."""
    rows = query(url, completions_with_text().where(COMPLETIONS.c.request_id.in_(list(answered))))
    assert {r.request_id: r.text for r in rows} == answered
    if instance_columns(url)["requests"]:
        bindings = query(
            url, select(REQUESTS.c.request_id, REQUESTS.c.instance_id).where(REQUESTS.c.request_id.in_(list(answered)))
        )
        assert len(bindings) == len(answered) and all(b.instance_id for b in bindings)
        assert len({b.instance_id for b in bindings}) >= 2, "two replicas served, each under its own instance id"


@pytest.fixture
def deployment(tiny_llama, pg_db_url, tmp_path):
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    for name in ADAPTERS:
        (adapters / name).symlink_to(tiny_llama.adapters[name], target_is_directory=True)
    _, key = add_key(tmp_path / "keys.toml", tenant="acme", adapters=["*"])
    _, narrow = add_key(tmp_path / "keys.toml", tenant="initech", adapters=["qv_r4"])
    args = dict(model=str(tiny_llama.model_dir), audit_url=pg_db_url, adapters_dir=str(adapters), api_keys_file=str(tmp_path / "keys.toml"),
                served_model_name=[BASE], engine=ENGINE, shutdown_grace_seconds=5.0)  # fmt: skip
    return args, key, narrow


def single_engine_texts(tiny_llama, tmp_path) -> dict[tuple[str, str], str]:
    """The reference: one engine (`loraledger serve`'s app in this process), every model on every prompt."""
    config = ServerConfig(
        engine_args=EngineArgs(model=str(tiny_llama.model_dir), enable_lora=True, audit_url=None, **ENGINE),
        served_model_name=(BASE,),
        lora_modules=tuple(LoRAModule(name, str(tiny_llama.adapters[name])) for name in ADAPTERS),
    )
    with (
        LiveServer(config) as single,
        openai.OpenAI(base_url=f"{single.base_url}/v1", api_key="none", max_retries=0, timeout=60) as client,
    ):
        return {(m, p): ask(client, m, p, stream=False)[1] for m in MODELS for p in PROMPTS[:2]}


def test_two_replicas_serve_like_one_engine_and_a_killed_one_loses_nothing_released(deployment, tiny_llama, tmp_path):
    args, key, narrow = deployment
    expected = single_engine_texts(tiny_llama, tmp_path)
    with (
        RayServe(args, replicas=2) as cluster,
        openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=key, max_retries=0, timeout=60) as client,
    ):
        # mixed adapters, concurrent, half of them streamed
        cases = [
            (m, p, i % 2 == 1) for i, (m, p) in enumerate((m, p) for p in PROMPTS[:2] for m in MODELS for _ in range(2))
        ]
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda c: (c, ask(client, *c)), cases))
        for (model, prompt, stream), (_, text) in got:
            assert text == expected[(model, prompt)], f"{model} (stream={stream}) differs from one engine's output"
        answered = {rid: text for _, (rid, text) in got}

        with pytest.raises(openai.PermissionDeniedError):  # the replicas check keys exactly as `loraledger serve` does
            openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=narrow, max_retries=0).completions.create(
                model="all_r8", prompt="x", max_tokens=1
            )
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="not-a-key", max_retries=0).completions.create(
                model="qv_r4", prompt="x", max_tokens=1
            )
        with pytest.raises(openai.NotFoundError, match="no adapter folder"):
            client.completions.create(model="no_such_adapter", prompt="x", max_tokens=1)
        refused = httpx.post(
            f"{cluster.base_url}/v1/load_lora_adapter",
            json={"lora_name": "x", "lora_path": "/x"},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "adapters_from_folder"
        assert BASE in {m.id for m in client.models.list()}

        # load from four clients; one replica is killed with SIGKILL once responses are flowing
        pids = cluster.replica_pids()
        assert len(pids) == 2
        flowing, stop = threading.Event(), threading.Event()
        lock = threading.Lock()
        failures: list[str] = []

        def load(worker: int) -> None:
            i = 0
            while not stop.is_set():
                model, prompt = MODELS[(worker + i) % len(MODELS)], PROMPTS[i % len(PROMPTS)]
                i += 1
                try:
                    rid, text = ask(client, model, prompt, stream=(i % 2 == 0), max_tokens=12)
                except openai.APIStatusError as exc:  # the dead replica's requests, refused by the router
                    with lock:
                        failures.append(exc.status_code)
                    continue
                except (openai.APIConnectionError, httpx.HTTPError, CutStream):  # ... or cut off mid-response
                    with lock:
                        failures.append(0)
                    continue
                with lock:
                    answered[rid] = text
                    if len(answered) >= len(cases) + 4:
                        flowing.set()

        workers = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(4)]
        for w in workers:
            w.start()
        assert flowing.wait(60), "no responses under load"
        os.kill(pids[0], signal.SIGKILL)
        time.sleep(2.0)
        stop.set()
        for w in workers:
            w.join(90)
        cluster.wait_healthy(timeout=90)  # Ray has started a replacement
        assert sorted(cluster.replica_pids()) != sorted(pids)
        for model in MODELS:  # the replacement (and its peer) serve on
            rid, text = ask(client, model, PROMPTS[0], stream=False)
            assert text == expected[(model, PROMPTS[0])]
            answered[rid] = text

    assert set(failures) <= {0, 503}, failures  # a dead replica's requests are refused (503) or cut off, nothing else
    assert_on_record(args["audit_url"], answered)
    with AuditLog(args["audit_url"]) as log:
        result = log.verify()
    assert result.ok, result.problems
