"""The unload's holds, on their own: an unload waits for the requests already on their way to the engine, a request
that checks in after the unload began is refused (404), and an unload whose requests do not get admitted in time is
a 503 that a retry finishes."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from loraledger.lora.request import LoRARequest
from loraledger.server import serving_models
from loraledger.server.error_responses import APIError
from loraledger.server.serving_models import OpenAIServingModels


class _Engine:
    def __init__(self) -> None:
        self.removed: list[int] = []

    async def remove_lora(self, int_id: int) -> bool:
        self.removed.append(int_id)
        return True


def _models() -> tuple[OpenAIServingModels, _Engine, LoRARequest]:
    engine = _Engine()
    config = SimpleNamespace(served_model_name=("base",), engine_args=SimpleNamespace(model="/m"), lora_resolvers=(),
                             lora_resolver_max_loras=1)  # fmt: skip
    models = OpenAIServingModels(SimpleNamespace(config=config, engine=engine))
    lora = LoRARequest("a", 1, "/adapters/a")
    models.adapters["a"] = lora
    return models, engine, lora


async def test_an_unload_waits_for_the_holds_and_later_requests_are_refused():
    models, engine, lora = _models()
    hold = models.hold(lora)
    async with anyio.create_task_group() as tg:
        tg.start_soon(models.unload, "a")
        await anyio.wait_all_tasks_blocked()
        assert engine.removed == []  # a request is on its way in: the adapter stays in the engine
        with pytest.raises(APIError, match="was unloaded"):
            models.hold(lora)  # one that checks in now is refused
        hold.release()
    assert engine.removed == [1]
    hold.release()  # idempotent


async def test_an_unload_past_its_wait_is_a_503_and_a_retry_finishes_it(monkeypatch):
    monkeypatch.setattr(serving_models, "UNLOAD_WAIT_SECONDS", 0.05)
    models, engine, lora = _models()
    hold = models.hold(lora)
    with pytest.raises(APIError) as refused:
        await models.unload("a")
    assert refused.value.status == 503 and refused.value.code == "adapter_unloading"
    assert engine.removed == [] and "a" not in models.adapters
    with pytest.raises(APIError) as again:
        await models.load("a", "/adapters/a")
    assert again.value.code == "adapter_unloading"
    hold.release()
    await models.unload("a")
    assert engine.removed == [1]
