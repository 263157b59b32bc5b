"""loraledger.paths: one root for everything the package writes of its own, and nothing written into the user's home."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from loraledger import paths

WORKLOAD = textwrap.dedent(
    """
    import sys
    from loraledger import LLM, LoRARequest, SamplingParams
    from loraledger.cli import main

    model, adapter = sys.argv[1], sys.argv[2]
    # the default audit database, the fingerprint cache, the demo's model: all from loraledger.paths
    with LLM(model=model, enable_lora=True, max_lora_rank=16) as llm:
        outs = llm.generate(["hello", "world"], SamplingParams(max_tokens=3), lora_request=[None, LoRARequest("a", 1, adapter)])
    assert len(outs) == 2
    for argv in (["audit", "verify"], ["audit", "requests"], ["audit", "show", outs[0].request_id],
                 ["db", "current"], ["demo", "--random-model", "--max-tokens", "2", "--device", "cpu"]):
        assert main(argv) == 0, argv
    """
)


def test_home_root_holds_cache_and_data(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path))
    assert paths.cache_dir() == tmp_path / "cache"
    assert paths.data_dir() == tmp_path / "data"
    assert paths.default_audit_url() == f"sqlite:///{tmp_path / 'data' / 'audit.sqlite3'}"
    monkeypatch.delenv(paths.HOME_ENV)
    assert paths.cache_dir() != tmp_path / "cache"


def test_the_suite_runs_under_its_own_home():
    home = Path(os.environ[paths.HOME_ENV])
    assert home.is_dir() and paths.cache_dir().is_relative_to(home) and paths.data_dir().is_relative_to(home)


def test_a_workload_writes_nothing_into_home(tiny_llama, tmp_path):
    """Engine, audit log, CLI and demo with every default, HOME an empty folder: only $LORALEDGER_HOME gets files."""
    home, root = tmp_path / "home", tmp_path / "loraledger-home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_") and k != "LORALEDGER_AUDIT_URL"}
    env.update(HOME=str(home), LORALEDGER_HOME=str(root))
    adapter = tiny_llama.adapters["all_r8"]
    result = subprocess.run(
        [sys.executable, "-c", WORKLOAD, str(tiny_llama.model_dir), str(adapter)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    written = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    assert written == [], f"written into HOME: {written}"
    assert (root / "data" / "audit.sqlite3").is_file()
    assert (root / "cache" / "model_fingerprints.json").is_file()
    assert (root / "cache" / "demo" / "random-v1" / ".complete").is_file()
