"""Models and adapters named by Hub repo ids, end to end through the engine, against tests/fake_hub.py: the outputs
equal the same run from folders, and the commits read are on record, under the chain."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from sqlalchemy import select

from loraledger import LLM, LoRARequest, SamplingParams
from loraledger.audit import AuditLog
from loraledger.audit.report import write_report
from loraledger.cli import main
from loraledger.lora.checkpoint_reader import fingerprint_adapter
from loraledger.sources import HubNotFoundError, HubOfflineError
from loraledger.store.audit_store import ADAPTERS, REQUESTS, AuditStore
from loraledger.store.models import Instance
from tests.api.conftest import random_prompts
from tests.audit.tampering import tamper

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts(2, seed=7)


def run(model: str, loras: list[LoRARequest | None], url: str | None, **extra) -> list[list[int]]:
    with LLM(model=model, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, audit_url=url, **extra) as llm:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in loras]
        outs = llm.generate(prompts, GREEDY, lora_request=[lora for _ in PROMPTS for lora in loras], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def rows(url: str) -> dict[str, list]:
    with AuditStore(url) as store, store.engine.connect() as conn:
        return {
            "adapters": conn.execute(select(ADAPTERS).order_by(ADAPTERS.c.first_seen)).all(),
            "requests": conn.execute(select(REQUESTS).where(REQUESTS.c.lora_name.is_not(None))).all(),
            "instances": conn.execute(select(Instance.__table__)).all(),
        }


@pytest.fixture
def hub(fake_hub, tiny_llama):
    fake_hub.model_sha = fake_hub.push("org/tiny", tiny_llama.model_dir)
    fake_hub.adapter_sha = fake_hub.push("org/qv", tiny_llama.adapters["qv_r4"])
    return fake_hub


def test_hub_ids_run_as_the_folders_do_and_the_commits_are_on_record(hub, tiny_llama, tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    folders = run(str(tiny_llama.model_dir), [None, LoRARequest("qv", 1, str(tiny_llama.adapters["qv_r4"]))], None)
    assert run("org/tiny", [None, LoRARequest("qv", 1, "org/qv")], url) == folders
    log = rows(url)
    (instance,) = log["instances"]
    assert (instance.model, instance.model_repo_id, instance.model_revision, instance.model_commit_sha) == (
        "org/tiny",
        "org/tiny",
        "main",
        hub.model_sha,
    )
    assert (instance.tokenizer_repo_id, instance.tokenizer_commit_sha) == ("org/tiny", hub.model_sha)
    (adapter,) = log["adapters"]
    assert adapter.fingerprint == fingerprint_adapter(str(tiny_llama.adapters["qv_r4"]))  # the bytes loaded
    assert (adapter.path, adapter.repo_id, adapter.revision, adapter.commit_sha) == (
        "org/qv",
        "org/qv",
        "main",
        hub.adapter_sha,
    )
    assert {(r.adapter_repo_id, r.adapter_revision, r.adapter_commit_sha) for r in log["requests"]} == {
        ("org/qv", "main", hub.adapter_sha)
    }

    # offline, from the cache the first run filled: the same outputs, no request to the Hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    asked = hub.requests.total()
    assert run("org/tiny", [None, LoRARequest("qv", 1, "org/qv")], url) == folders
    assert hub.requests.total() == asked
    with pytest.raises(HubOfflineError):
        run("org/tiny", [LoRARequest("other", 2, "org/not-cached")], None)
    monkeypatch.delenv("HF_HUB_OFFLINE")

    # a new commit on main with new weights: a new fingerprint and a new adapters row; the old one pinned by sha
    new_sha = hub.push("org/qv", tiny_llama.adapters["all_r8"])
    pinned = LoRARequest("qv-then", 2, f"org/qv@{hub.adapter_sha}")
    run("org/tiny", [LoRARequest("qv", 1, "org/qv"), pinned], url)
    log = rows(url)
    assert [(a.commit_sha, a.revision) for a in log["adapters"]] == [(hub.adapter_sha, "main"), (new_sha, "main")]
    assert log["adapters"][1].fingerprint == fingerprint_adapter(str(tiny_llama.adapters["all_r8"]))
    by_commit = {(r.lora_path, r.adapter_revision, r.adapter_commit_sha) for r in log["requests"]}
    assert (f"org/qv@{hub.adapter_sha}", hub.adapter_sha, hub.adapter_sha) in by_commit
    assert ("org/qv", "main", new_sha) in by_commit
    with AuditLog(url) as audit:
        assert audit.verify().ok


def test_audit_show_adapters_instances_and_report_name_the_commits(hub, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    run("org/tiny", [LoRARequest("qv", 1, "org/qv")], url)
    request = rows(url)["requests"][0]
    assert main(["audit", "show", request.request_id, "--url", url]) == 0
    shown = capsys.readouterr().out
    assert f"model         org/tiny @ main, commit {hub.model_sha}" in shown
    assert f"adapter from  org/qv @ main, commit {hub.adapter_sha}" in shown
    assert main(["audit", "adapters", "--url", url, "--format", "jsonl"]) == 0
    (listed,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert (listed["repo_id"], listed["revision"], listed["commit_sha"]) == ("org/qv", "main", hub.adapter_sha)
    assert main(["audit", "instances", "--url", url, "--format", "jsonl"]) == 0
    (instance,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert instance["model_commit_sha"] == hub.model_sha
    with AuditLog(url) as audit:
        manifest = write_report(
            audit,
            tmp_path / "bundle",
            since="2000-01-01",
            until="2100-01-01",
            fmt="jsonl",
            unsigned=True,
            progress=False,
        )
    assert [m["model_commit_sha"] for m in manifest["sources"]["instances"]] == [hub.model_sha]
    assert [a["commit_sha"] for a in manifest["sources"]["adapters"]] == [hub.adapter_sha]
    assert f"org/qv @ main, commit {hub.adapter_sha}" in (tmp_path / "bundle" / "report.html").read_text()
    exported = (tmp_path / "bundle" / "requests.jsonl").read_text().splitlines()
    assert json.loads(exported[0])["adapter_commit_sha"] == hub.adapter_sha


@pytest.mark.parametrize(
    "table, column, key",
    [
        ("adapters", "commit_sha", "fingerprint"),
        ("requests", "adapter_commit_sha", "request_id"),
        ("instances", "model_commit_sha", "instance_id"),
        ("adapters", "revision", "fingerprint"),
    ],
)
def test_verify_finds_a_rewritten_commit(hub, tmp_path, table, column, key):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    run("org/tiny", [LoRARequest("qv", 1, "org/qv")], url)
    tamper(url, f"UPDATE {table} SET {column} = :forged", forged="f" * 40)
    with AuditLog(url) as audit:
        result = audit.verify()
    assert not result.ok
    assert any(p.table == table and column in p.message for p in result.problems), result.problems


def test_a_bad_repo_fails_its_request_and_the_engine_goes_on(hub, tiny_llama):
    with LLM(model="org/tiny", enable_lora=True, max_lora_rank=16, block_size=4, audit_url=None) as llm:
        with pytest.raises(HubNotFoundError, match="org/missing"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, lora_request=LoRARequest("x", 1, "org/missing"))
        (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_a_model_revision_is_resolved_and_a_tokenizer_revision_follows_it(hub, tiny_llama, tmp_path):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    tagged = hub.push("org/tiny", tiny_llama.model_dir, branch="v1")
    run("org/tiny", [None], url, revision="v1")
    (instance,) = rows(url)["instances"]
    assert (instance.model_revision, instance.model_commit_sha) == ("v1", tagged)
    assert (instance.tokenizer_revision, instance.tokenizer_commit_sha) == ("v1", tagged)


def test_an_adapter_read_again_after_eviction_stays_at_its_commit_until_reloaded_in_place(hub, tiny_llama, tmp_path):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    other = LoRARequest("other", 2, str(tiny_llama.adapters["ogd_r16_rslora"]))
    qv = LoRARequest("qv", 1, "org/qv")
    one = [{"prompt_token_ids": PROMPTS[0]}]
    with LLM(model="org/tiny", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16, block_size=4,
             audit_url=url) as llm:  # fmt: skip
        llm.generate(one, GREEDY, lora_request=qv, use_tqdm=False)
        new_sha = hub.push("org/qv", tiny_llama.adapters["all_r8"])  # main moves on
        llm.generate(one, GREEDY, lora_request=other, use_tqdm=False)  # evicts qv from the host cache
        llm.generate(one, GREEDY, lora_request=qv, use_tqdm=False)  # read again: the commit it was first read at
        assert {r.adapter_commit_sha for r in rows(url)["requests"] if r.lora_name == "qv"} == {hub.adapter_sha}
        reload = LoRARequest("qv", 1, "org/qv", load_inplace=True)
        llm.generate(one, GREEDY, lora_request=reload, use_tqdm=False)
    commits = [r.adapter_commit_sha for r in sorted(rows(url)["requests"], key=lambda r: r.received_at)]
    assert [c for c in commits if c is not None] == [hub.adapter_sha, hub.adapter_sha, new_sha]


def test_generate_cli_takes_hub_ids(hub, tiny_llama, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    argv = ["generate", "--model", "org/tiny", "--lora", f"qv=org/qv@{hub.adapter_sha}", "--prompt", "hello",
            "--max-tokens", "2", "--max-lora-rank", "16", "--audit-url", url]  # fmt: skip
    assert main(argv) == 0
    assert fingerprint_adapter(str(tiny_llama.adapters["qv_r4"]))[:12] in capsys.readouterr().out
    (adapter,) = rows(url)["adapters"]
    assert (adapter.repo_id, adapter.revision, adapter.commit_sha) == ("org/qv", hub.adapter_sha, hub.adapter_sha)


def test_a_tokenizer_from_its_own_repo_and_download_dir(hub, tiny_llama, tmp_path):
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    tokenizer_files = {p.name: p.read_bytes() for p in tiny_llama.model_dir.iterdir() if p.name.startswith("tokenizer")}
    tok_sha = hub.push("org/tok", tokenizer_files, branch="v2")
    cache = tmp_path / "downloads"
    run("org/tiny", [None], url, tokenizer="org/tok", tokenizer_revision="v2", download_dir=str(cache))
    (instance,) = rows(url)["instances"]
    assert (instance.tokenizer, instance.tokenizer_repo_id, instance.tokenizer_revision) == ("org/tok", "org/tok", "v2")
    assert instance.tokenizer_commit_sha == tok_sha and instance.model_revision == "main"
    assert (cache / "models--org--tok" / "snapshots" / tok_sha / "tokenizer.json").is_file()
    assert (cache / "models--org--tiny" / "refs" / "main").read_text() == hub.model_sha


def test_a_hub_adapters_own_tokenizer_and_chat_template_serve_its_requests(hub, tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    from tests.api.test_chat import ADAPTER_TEMPLATE, _swapped_tokenizer

    folder, template_only = tmp_path / "own", tmp_path / "template-only"
    for dest in (folder, template_only):
        shutil.copytree(tiny_llama.adapters["all_r8"], dest)
    _swapped_tokenizer(tiny_llama.model_dir, folder)  # its own tokenizer and chat_template.jinja
    (template_only / "tokenizer_config.json").write_text(json.dumps({"chat_template": ADAPTER_TEMPLATE}))
    hub.push("org/own", folder)
    hub.push("org/tpl", {p.name: p.read_bytes() for p in template_only.iterdir() if p.name != "tokenizer_config.json"}
             | {"chat_template.jinja": ADAPTER_TEMPLATE.encode()})  # fmt: skip
    text = "The cat and the dog sleep in the warm sun"
    own = AutoTokenizer.from_pretrained(folder)
    url = f"sqlite:///{tmp_path / 'audit.sqlite3'}"
    chat = [{"role": "user", "content": text}]
    with LLM(model="org/tiny", enable_lora=True, max_lora_rank=16, block_size=4, audit_url=url) as llm:
        lora = LoRARequest("own", 1, "org/own")
        (out,) = llm.generate(text, GREEDY, lora_request=lora, use_tqdm=False)
        assert out.prompt_token_ids == own(text)["input_ids"]
        # chat: rendered with the adapter's template and tokenized with its tokenizer, read from the commit loaded
        (said,) = llm.chat(chat, GREEDY, lora_request=lora, use_tqdm=False)
        expected = own.apply_chat_template(
            chat, chat_template=ADAPTER_TEMPLATE, add_generation_prompt=True, tokenize=False
        )
        assert said.prompt == expected
        assert said.prompt_token_ids == own(expected, add_special_tokens=False)["input_ids"]
        # an adapter with only a chat template: the model's tokenizer with the adapter's template
        (tpl,) = llm.chat(chat, GREEDY, lora_request=LoRARequest("tpl", 2, "org/tpl"), use_tqdm=False)
        assert tpl.prompt.endswith("[ANSWER]") and tpl.prompt.count("[USER]") == 1
        assert llm.get_tokenizer(LoRARequest("tpl", 2, "org/tpl")).chat_template == ADAPTER_TEMPLATE
    sha = hashlib.sha256(ADAPTER_TEMPLATE.encode()).hexdigest()
    assert {r.lora_name: r.chat_template_sha256 for r in rows(url)["requests"] if r.chat_template_sha256} == {
        "own": sha,
        "tpl": sha,
    }
