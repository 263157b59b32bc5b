"""Crash recovery: an engine killed with SIGKILL mid-run loses nothing it released and half-writes nothing; the next
start records the interrupted requests, and with resume_interrupted re-runs them under their original binding."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest
from safetensors.torch import load_file, save_file
from sqlalchemy import select

from loraledger import AsyncEngine, EngineArgs, RequestOutput
from loraledger.errors import AdapterChangedError
from loraledger.lora.checkpoint_reader import fingerprint_adapter
from loraledger.store.audit_store import COMPLETIONS, EVENTS, REQUESTS, AuditStore
from loraledger.store.records import EventKind
from loraledger.store.texts import stored as stored_texts
from tests.stress.checks import log_problems
from tests.stress.kill9 import run_rounds
from tests.stress.zygote import Zygote, parse_lines, run_argv

LONG_REQUESTS = 8  # two per adapter and two on the base model (the engine process goes round robin)
CHANGED = "qv_r4"  # the adapter whose file is edited between the crash and the restart


@pytest.fixture(scope="module")
def zygote(tiny_llama, tmp_path_factory):
    """The engine processes of this module fork from one process that did the imports (seconds) once."""
    with Zygote(tiny_llama.model_dir, tmp_path_factory.mktemp("zygote") / "stderr") as z:
        yield z


def test_kill9_mid_run_loses_nothing_released_and_recovery_marks_the_rest(db_url, tiny_llama, zygote):
    loras = {name: str(path) for name, path in sorted(tiny_llama.adapters.items())}
    summary = run_rounds(
        zygote,
        tiny_llama.model_dir,
        loras,
        db_url,
        rounds=3,
        seed=11,
        modes=("released", "timer", "admitted"),
        commit_delays_ms=(20, 20, 0),
    )
    assert summary.problems == [], summary.render()
    # the kills did land in the middle of runs: outputs had been released and others were still in flight
    assert summary.released > 0 and summary.interrupted > 0, summary.render()


def crash_during_long_requests(zygote: Zygote, model_dir: Path, loras: dict[str, Path], url: str) -> list[str]:
    """Run an engine with LONG_REQUESTS long greedy requests and SIGKILL it as soon as all are admitted; its output lines.
    The requests are long enough (160 tokens) that none finishes while the kill travels on a loaded machine."""
    extra = ["--long", "--requests", str(LONG_REQUESTS), "--in-flight", str(LONG_REQUESTS), "--max-tokens", "160"]
    run = zygote.run(run_argv(model_dir, loras, url, "resume", seed=3, extra=extra))
    try:
        run.expect("ADMITTED", LONG_REQUESTS)
    finally:
        run.kill()
    return run.lines


def change_adapter_weights(folder: Path) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 0.25
    save_file(tensors, path, metadata={"format": "pt"})


async def test_resume_reruns_interrupted_requests_under_their_binding_or_refuses(db_url, tiny_llama, zygote, tmp_path):
    loras = {name: Path(shutil.copytree(path, tmp_path / name)) for name, path in sorted(tiny_llama.adapters.items())}
    bound = {name: fingerprint_adapter(str(path)) for name, path in loras.items()}
    lines = await anyio.to_thread.run_sync(crash_during_long_requests, zygote, tiny_llama.model_dir, loras, db_url)
    admitted, released, _ = parse_lines(lines)
    assert log_problems(db_url, admitted, released) == []
    with AuditStore(db_url) as store:
        unfinished = {r.request_id: r for r in store.unfinished_requests()}
    refused = {rid for rid, r in unfinished.items() if r.lora_name == CHANGED}
    rerun = set(unfinished) - refused
    names = {unfinished[rid].lora_name for rid in rerun}
    assert refused and None in names and len(names) >= 2, (
        f"the kill came too late: only {sorted(unfinished)} were unfinished"
    )

    change_adapter_weights(loras[CHANGED])
    on_disk = fingerprint_adapter(str(loras[CHANGED]))
    assert on_disk != bound[CHANGED]
    args = EngineArgs(
        model=str(tiny_llama.model_dir),
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        block_size=4,
        audit_url=db_url,
        resume_interrupted=True,
    )
    async with AsyncEngine(args) as engine:
        with anyio.fail_after(180):  # 6 x 160 greedy tokens: seconds, unless a shared 2-core machine is oversubscribed
            resumed = await engine.wait_resumed()
        assert sorted(engine.interrupted) == sorted(unfinished)
        me = engine.instance_id

    assert set(resumed) == set(unfinished)
    for rid in refused:
        assert isinstance(resumed[rid], AdapterChangedError), resumed[rid]
    with AuditStore(db_url) as store:
        with store.engine.connect() as conn:
            rows = {
                c.request_id: c
                for c in conn.execute(select(COMPLETIONS).where(COMPLETIONS.c.request_id.in_(sorted(unfinished))))
            }
            texts = stored_texts(conn, unfinished)
            events = list(
                conn.execute(
                    select(EVENTS.c.kind, EVENTS.c.request_id, EVENTS.c.payload).where(
                        EVENTS.c.request_id.in_(sorted(unfinished))
                    )
                )
            )
            # another instance's requests: the binding keeps the dead instance that admitted it, the replacement
            # (this engine) records their interruption, resumption and outputs under its own id
            owners = set(
                conn.execute(
                    select(REQUESTS.c.instance_id).where(REQUESTS.c.request_id.in_(sorted(unfinished)))
                ).scalars()
            )
            kinds = (EventKind.REQUEST_INTERRUPTED, EventKind.REQUEST_RESUMED, EventKind.REQUEST_FINISHED)
            writers = set(
                conn.execute(
                    select(EVENTS.c.instance_id).where(
                        EVENTS.c.request_id.in_(sorted(unfinished)), EVENTS.c.kind.in_(kinds)
                    )
                ).scalars()
            )
        assert len(owners) == 1 and None not in owners and owners != {me} and writers == {me}
        assert store.first_break() is None
        assert store.unfinished_requests() == []

    def of_kind(kind: str) -> dict[str, list[dict]]:
        found: dict[str, list[dict]] = {}
        for k, rid, payload in events:
            if k == kind:
                found.setdefault(rid, []).append(payload)
        return found

    assert set(of_kind(EventKind.REQUEST_INTERRUPTED)) == set(unfinished)
    assert set(of_kind(EventKind.REQUEST_RESUMED)) == rerun
    assert set(of_kind(EventKind.REQUEST_FINISHED)) == rerun
    assert of_kind(EventKind.RESUME_REFUSED) == {
        rid: [{"bound_fingerprint": bound[CHANGED], "fingerprint_on_disk": on_disk}] for rid in refused
    }
    assert set(rows) == rerun  # a refused request gets no output at all
    for rid in rerun:
        out = resumed[rid]
        assert isinstance(out, RequestOutput) and out.finished, out
        binding = unfinished[rid]
        expected = bound[binding.lora_name] if binding.lora_name else None
        assert binding.adapter_fingerprint == expected
        assert rows[rid].adapter_fingerprint == expected  # the same binding, now with its output
        kept = texts[(rid, "completion", 0)]  # salted text, kept apart from the row
        assert kept.token_ids == out.outputs[0].token_ids and kept.text == out.outputs[0].text
