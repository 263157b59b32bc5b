"""In every actor the handling of one request's message is a failure boundary.

An unexpected exception (injected here) while an actor handles one request fails that request with a
typed error, the exception attached as its cause, and the engine and every other request go on, the
failure on record. An exception that escapes an actor (a broken engine invariant) stops the engine:
everyone gets EngineDeadError naming it, and the caller's code around the engine is not cancelled.
"""

from __future__ import annotations

import anyio
import pytest
from sqlalchemy import select

from loraledger import AsyncEngine, EngineArgs, LoRARequest, SamplingParams
from loraledger import errors as E
from loraledger.actors import adapter_loader
from loraledger.actors.admission import Admission
from loraledger.actors.output_assembler import OutputAssembler
from loraledger.scheduling.policy import SchedulingPolicy
from loraledger.store.audit_store import EVENTS, REQUESTS, AuditStore
from loraledger.store.records import EventKind
from tests.api.conftest import loras_for, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts(3, seed=41)
# the victim's own prompt: past admission, actors know a request by its audit key, which the engine makes
VICTIM_PROMPT = [9, 9, 9, 9, 9, 9, 9]


class Injected(RuntimeError):
    pass


def _inject(monkeypatch, where: str) -> None:
    """Make the actor `where` raise Injected while it handles the request (or adapter) called "victim"."""
    if where == "admission":
        original = Admission._model_inputs

        async def patched(self, msg, *args):
            if msg.caller_request_id == "victim":
                raise Injected("admission")
            return await original(self, msg, *args)

        monkeypatch.setattr(Admission, "_model_inputs", patched)
    elif where == "scheduler":
        original = SchedulingPolicy.add

        def patched(self, msg):
            if msg.prompt_token_ids == VICTIM_PROMPT:
                raise Injected("scheduler")
            return original(self, msg)

        monkeypatch.setattr(SchedulingPolicy, "add", patched)
    elif where == "assembler":
        original = OutputAssembler._on_update

        async def patched(self, req, update, touched):
            if req.msg.prompt_token_ids == VICTIM_PROMPT and req.seqs[0].token_ids:
                raise Injected("assembler")  # after the first token: the request is half assembled
            return await original(self, req, update, touched)

        monkeypatch.setattr(OutputAssembler, "_on_update", patched)
    elif where == "loader":
        original = adapter_loader.load_lora_checkpoint

        def patched(path, **kwargs):
            if kwargs["lora_name"] == "victim":
                raise Injected("loader")
            return original(path, **kwargs)

        monkeypatch.setattr(adapter_loader, "load_lora_checkpoint", patched)


@pytest.mark.parametrize("where", ["admission", "scheduler", "assembler", "loader"])
def test_an_unexpected_error_fails_that_request_only(tiny_llama, tmp_path, monkeypatch, where):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    loras = loras_for(tiny_llama)
    args = EngineArgs(
        model=str(tiny_llama.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, audit_url=url
    )
    _inject(monkeypatch, where)
    victim_lora = LoRARequest("victim", 50, str(tiny_llama.adapters["qv_r4"])) if where == "loader" else None

    async def main():
        async with AsyncEngine.from_engine_args(args) as engine:

            async def one(rid, prompt, lora):
                out = None
                async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY, rid, lora):
                    pass
                return out.outputs[0].token_ids

            reference = [await one(f"ref-{i}", p, loras["all_r8"] if i else None) for i, p in enumerate(PROMPTS)]
            results: dict[str, object] = {}

            async def run(rid, prompt, lora):
                try:
                    results[rid] = await one(rid, prompt, lora)
                except Exception as exc:
                    results[rid] = exc

            async with anyio.create_task_group() as tg:  # the victim runs among good requests
                for i, p in enumerate(PROMPTS):
                    tg.start_soon(run, f"good-{i}", p, loras["all_r8"] if i else None)
                tg.start_soon(run, "victim", VICTIM_PROMPT, victim_lora)
            after = await one("after", PROMPTS[1], loras["all_r8"])  # the engine still serves
            return reference, results, after

    reference, results, after = anyio.run(main)
    error = results["victim"]
    expected_type = E.AdapterError if where == "loader" else E.RequestFailedError
    assert isinstance(error, expected_type), repr(error)
    assert isinstance(error.__cause__, Injected)
    if where != "loader":
        assert "victim" in str(error) and where.replace("assembler", "output assembler") in str(error)
    assert [results[f"good-{i}"] for i in range(3)] == reference
    assert after == reference[1]
    with AuditStore(url) as store:
        assert store.first_break() is None
        with store.engine.connect() as conn:
            # by the callers' ids: events are keyed by the audit keys the requests rows hold beside them
            callers = dict(conn.execute(select(REQUESTS.c.request_id, REQUESTS.c.caller_request_id)).all())
            ends = {
                callers[rid]: kind
                for kind, rid in conn.execute(
                    select(EVENTS.c.kind, EVENTS.c.request_id).where(EVENTS.c.request_id.is_not(None))
                )
                if kind in EventKind.TERMINAL
            }
    assert all(ends[f"good-{i}"] == EventKind.REQUEST_FINISHED for i in range(3))
    if where in ("scheduler", "assembler"):  # admitted (on record) before it failed: its end is on record too
        assert ends["victim"] == EventKind.REQUEST_FAILED
    else:
        assert "victim" not in ends  # refused at admission: never on record as admitted


def test_an_error_escaping_an_actor_stops_the_engine_without_cancelling_the_caller(tiny_llama, monkeypatch):
    args = EngineArgs(model=str(tiny_llama.model_dir), block_size=4, audit_url=None)
    calls = {"n": 0}
    original = SchedulingPolicy.schedule

    def broken(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Injected("the scheduler's own state is broken")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SchedulingPolicy, "schedule", broken)

    async def main():
        async with AsyncEngine.from_engine_args(args) as engine:
            with pytest.raises(E.EngineDeadError):
                async for _ in engine.generate(
                    {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=20, ignore_eos=True), "in-flight"
                ):
                    pass
            with pytest.raises(E.EngineDeadError) as info:
                await engine.submit("later", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
            await anyio.sleep(0)  # the caller's code goes on: nothing cancelled it
            return info.value

    error = anyio.run(main)
    assert "Injected" in str(error) and isinstance(error.__cause__, Injected)
