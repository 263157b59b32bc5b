"""EngineClient, the engine's public seam: AsyncEngine implements it, and its state follows the engine's life; the sync
LLMEngine's bridge to the engine's event loop is public too (LLM and AsyncLLMEngine cross it)."""

from __future__ import annotations

import pytest

from loraledger import AsyncEngine, EngineArgs, SamplingParams
from loraledger.engine_client import EngineClient
from loraledger.errors import EngineDeadError
from loraledger.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


async def test_the_seam_follows_the_engines_life(tiny_llama, tmp_path):
    engine = AsyncEngine(EngineArgs(model=str(tiny_llama.model_dir), audit_url=f"sqlite:///{tmp_path / 'audit.db'}"))
    assert not engine.is_running and not engine.errored
    with pytest.raises(EngineDeadError):
        engine.store  # noqa: B018 (the property raises)
    async with engine:
        assert isinstance(engine, EngineClient)  # every member is there (a stopped engine's store raises)
        assert engine.is_running and not engine.errored
        assert engine.store is not None and engine.store.instance_id == engine.instance_id
        outs = [out async for out in engine.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, "r1")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
    assert not engine.is_running and not engine.errored
    error = engine.dead_error
    assert isinstance(error, EngineDeadError) and error.__cause__ is None
    with pytest.raises(EngineDeadError):
        await engine.submit("r2", {"prompt_token_ids": [1]}, GREEDY)


async def test_without_auditing_the_store_is_none(tiny_llama):
    async with AsyncEngine(EngineArgs(model=str(tiny_llama.model_dir), audit_url=None)) as engine:
        assert engine.is_running and engine.store is None and engine.instance_id is None


def test_the_sync_engines_bridge_runs_calls_on_the_engines_loop(tiny_llama):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama.model_dir), audit_url=None))
    try:
        assert not engine.closed
        assert engine.call(engine.engine.list_loras) == set()
        assert engine.start_task(engine.engine.get_stats).result(timeout=30) is not None
    finally:
        engine.close()
    assert engine.closed
