"""Request ids as vLLM defines them, and the audit log's own keys beside them.

vLLM lets a caller reuse a request id once the earlier request has finished (or was aborted), and LLM.generate
numbers its requests "0", "1", ... per LLM instance. The audit log keys every request with an id the engine makes
(a UUIDv7: unique across engines and restarts, ordered by time) and keeps the caller's id beside it.
"""

from __future__ import annotations

import hashlib
import json
import uuid

import anyio
import pytest

from loraledger import LLM, AsyncEngine, EngineArgs, LLMEngine, SamplingParams
from loraledger.audit import AuditLog
from loraledger.audit_ids import new_audit_id
from loraledger.cli import main
from loraledger.errors import DuplicateRequestError
from tests.model_fixtures import CHAT_TEMPLATE

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def _args(tiny, url: str | None) -> EngineArgs:
    return EngineArgs(model=str(tiny.model_dir), block_size=4, audit_url=url)


def _is_uuid7(text: str) -> bool:
    return uuid.UUID(text).version == 7 and str(uuid.UUID(text)) == text


def test_audit_ids_are_uuid7_unique_and_ordered_by_time():
    """The audit key: a UUIDv7 in canonical text, later than every key this process made before it."""
    ids = [new_audit_id() for _ in range(5000)]
    assert all(_is_uuid7(i) for i in ids[:50])
    assert len(set(ids)) == len(ids) and ids == sorted(ids)


def test_llm_generate_numbers_requests_per_instance_and_outputs_carry_the_audit_key(tiny_llama, tmp_path):
    """vLLM: LLM.generate's request ids are "0", "1", ... from its per-instance request_counter, across calls."""
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    with LLM(model=str(tiny_llama.model_dir), audit_url=url) as llm:
        first = llm.generate(["a", "b"], GREEDY, use_tqdm=False)
        second = llm.generate("c", GREEDY, use_tqdm=False)
    with LLM(model=str(tiny_llama.model_dir), audit_url=url) as llm:
        other = llm.generate("d", GREEDY, use_tqdm=False)
    outs = first + second + other
    assert [o.request_id for o in outs] == ["0", "1", "2", "0"]
    keys = [o.audit_id for o in outs]
    assert all(_is_uuid7(k) for k in keys) and len(set(keys)) == 4 and keys[:3] == sorted(keys[:3])
    with AuditLog(url) as log:
        assert [log.request(k).binding.caller_request_id for k in keys] == ["0", "1", "2", "0"]
        assert log.verify().ok


def test_add_request_returns_the_id_and_a_finished_requests_id_may_be_reused(tiny_llama):
    """vLLM: LLMEngine.add_request returns the request id; an id may be used again once its request finished,
    while two unfinished requests with one id are an error."""
    engine = LLMEngine.from_engine_args(_args(tiny_llama, None))
    try:
        assert engine.add_request("job", "hello", GREEDY) == "job"
        with pytest.raises(DuplicateRequestError, match="'job'.*has not finished|'job'.*unfinished"):
            engine.add_request("job", "again", GREEDY)
        finals = []
        while engine.has_unfinished_requests():
            finals += [o for o in engine.step() if o.finished]
        assert engine.add_request("job", "hello", GREEDY) == "job"  # finished: free again
        while engine.has_unfinished_requests():
            finals += [o for o in engine.step() if o.finished]
    finally:
        engine.close()
    assert [o.request_id for o in finals] == ["job", "job"]
    assert finals[0].audit_id != finals[1].audit_id
    assert finals[0].outputs[0].token_ids == finals[1].outputs[0].token_ids


def test_abort_request_leaves_the_unfinished_counts_at_once_and_frees_the_id(tiny_llama, tmp_path):
    """vLLM's LLMEngine.abort_request drops the request from get_num_unfinished_requests() /
    has_unfinished_requests() at once and step() returns nothing more of it; the audit log says aborted."""
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    engine = LLMEngine.from_engine_args(_args(tiny_llama, url))
    try:
        engine.add_request("victim", "a long one", LONG)
        engine.add_request("bystander", "a short one", GREEDY)
        engine.step()
        assert engine.get_num_unfinished_requests() == 2
        engine.abort_request("victim")
        assert engine.get_num_unfinished_requests() == 1 and engine.has_unfinished_requests()
        engine.add_request("victim", "the id is free at once", GREEDY)  # not a DuplicateRequestError
        seen = []
        while engine.has_unfinished_requests():
            seen += engine.step()
        engine.abort_request("never-submitted")  # unknown ids are ignored
        assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    finally:
        engine.close()
    finished = {o.request_id: o for o in seen if o.finished}
    assert set(finished) == {"victim", "bystander"}
    assert finished["victim"].outputs[0].finish_reason == "length"  # the second "victim", not the aborted one
    with AuditLog(url) as log:
        keys, total = log.resolve_request_ids("victim")
        assert total == 2
        statuses = [log.request(k).status for k in keys]
        assert statuses == ["aborted", "finished"]
        assert log.verify().ok


async def test_two_live_requests_with_one_id_are_refused_and_a_finished_id_is_reused(tiny_llama):
    """vLLM: a request id in use by an unfinished request cannot be used again until that one ends."""
    async with AsyncEngine.from_engine_args(_args(tiny_llama, None)) as engine:
        stream = engine.generate("a long one", LONG, "same")
        first = await anext(stream)
        assert first.request_id == "same" and _is_uuid7(first.audit_id)
        with pytest.raises(DuplicateRequestError, match="'same'"):
            await engine.submit("same", "another", GREEDY)
        await stream.aclose()  # leaving the stream aborts it: the id is free
        with anyio.fail_after(60):
            outs = [o async for o in engine.generate("again", GREEDY, "same")]
    assert outs[-1].finished and outs[-1].request_id == "same" and outs[-1].audit_id != first.audit_id


def test_audit_show_finds_a_request_by_either_id_and_lists_a_reused_caller_id(tiny_llama_chat, tmp_path, capsys):
    """`loraledger audit show` takes the audit key (or a unique prefix of it) or the caller's id; a caller id used
    by several requests lists them all. A chat request's binding records its template's sha256."""
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    with LLM(model=str(tiny_llama_chat.model_dir), audit_url=url) as llm:
        (plain,) = llm.generate("hello", GREEDY, use_tqdm=False)
        (chat,) = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    other = LLM(model=str(tiny_llama_chat.model_dir), audit_url=url)
    try:
        (again,) = other.generate("hello again", GREEDY, use_tqdm=False)
    finally:
        other.close()
    assert (plain.request_id, chat.request_id, again.request_id) == ("0", "1", "0")

    def show(*argv: str) -> str:
        assert main(["audit", "show", *argv, "--url", url]) == 0
        return capsys.readouterr().out

    by_key = show(chat.audit_id)
    assert f"request {chat.audit_id}" in by_key and "caller id     1" in by_key
    template_sha = hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    assert f"chat template sha256 {template_sha}" in by_key
    assert "chat template" not in show(plain.audit_id)
    assert f"request {chat.audit_id}" in show("1")
    assert f"request {chat.audit_id}" in show(chat.audit_id[:30])  # a unique prefix of the key
    reused = show("0")
    assert "caller request id 0 was used by 2 requests" in reused
    assert reused.index(f"request {plain.audit_id}") < reused.index(f"request {again.audit_id}")
    listed = json.loads(show("0", "--format", "json"))
    assert [x["binding"]["request_id"] for x in listed] == [plain.audit_id, again.audit_id]
    with AuditLog(url) as log:
        assert log.request(chat.audit_id).binding.chat_template_sha256 == template_sha
        assert log.verify().ok
