"""AsyncLLMEngine and AsyncEngineArgs, vLLM's names: from_engine_args serves at once, without `async with`; shutdown() stops it."""

from __future__ import annotations

import asyncio

import pytest

from loraledger import AsyncEngineArgs, AsyncLLMEngine, LoRARequest, SamplingParams
from loraledger import errors as E
from tests.api.conftest import loras_for, random_prompts
from tests.model_fixtures import hf_reference_generate

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_from_engine_args_serves_at_once_and_shutdown_stops_it(tiny_llama):
    """The vLLM way: build the engine with a plain call (here, outside any event loop), then await its requests from
    asyncio; a refused request raises its own typed error, never an ExceptionGroup."""
    loras = loras_for(tiny_llama)
    prompts = random_prompts(3, seed=120)
    names = [None, "all_r8", "qv_r4"]
    ref = hf_reference_generate(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, 5, mixed=False).token_ids
    engine = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(
            model=str(tiny_llama.model_dir),
            enable_lora=True,
            max_loras=2,
            max_lora_rank=16,
            audit_url=None,
            disable_log_requests=True,
        )
    )

    async def one(i: int) -> list[int]:
        final = None
        async for out in engine.generate(
            {"prompt_token_ids": prompts[i]}, GREEDY, f"req-{i}", lora_request=loras[names[i]] if names[i] else None
        ):
            final = out
        assert final.finished and final.outputs[0].lora_request == (loras[names[i]] if names[i] else None)
        return final.outputs[0].token_ids

    async def main() -> list[list[int]]:
        assert engine.is_running and not engine.errored and engine.store is None  # audit_url=None
        await engine.check_health()
        results = await asyncio.gather(*(one(i) for i in range(3)))
        with pytest.raises(E.PromptError):
            async for _ in engine.generate("", GREEDY, "empty"):
                pass
        with pytest.raises(E.LoRARequestError):
            async for _ in engine.generate({"prompt_token_ids": prompts[0]}, GREEDY, "bad-lora", lora_request="qv_r4"):
                pass
        assert {loras["all_r8"].lora_int_id, loras["qv_r4"].lora_int_id} <= await engine.list_loras()
        assert (await engine.get_tokenizer()) is not None
        return results

    try:
        assert asyncio.run(main()) == ref
    finally:
        engine.shutdown()
    assert not engine.is_running and not engine.errored and isinstance(engine.dead_error, E.EngineDeadError)

    async def after() -> None:
        async for _ in engine.generate({"prompt_token_ids": prompts[0]}, GREEDY, "late"):
            pass

    with pytest.raises(E.EngineDeadError):
        asyncio.run(after())


def test_leaving_a_stream_early_aborts_it_and_async_with_still_works(tiny_llama):
    prompt = {"prompt_token_ids": random_prompts(1, seed=121)[0]}

    async def main() -> None:
        async with AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(model=str(tiny_llama.model_dir), audit_url=None)
        ) as engine:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            seen = 0
            async for _ in engine.generate(prompt, params, "leaver"):
                seen += 1
                if seen == 2:
                    break
            outs = [o async for o in engine.generate(prompt, GREEDY, "stayer")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
            await engine.abort("nobody")
        assert not engine.is_running

    asyncio.run(main())


def test_vllm_keywords_of_from_engine_args(tiny_llama):
    args = AsyncEngineArgs(model=str(tiny_llama.model_dir), audit_url=None)
    with pytest.raises(E.ConfigError, match="start_engine_loop"):
        AsyncLLMEngine.from_engine_args(args, start_engine_loop=False)
    with pytest.raises(E.ConfigError, match="did you mean 'stat_loggers'"):
        AsyncLLMEngine.from_engine_args(args, stat_logger=None)
    with pytest.raises(E.ConfigError, match="EngineArgs"):
        AsyncLLMEngine.from_engine_args({"model": "x"})
    assert isinstance(LoRARequest("a", 1, "/x"), LoRARequest)
