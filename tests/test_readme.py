"""Every Python and SQL example of README.md runs as shown, twice in a row, on the tiny fixture model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sqlalchemy import text

from loraledger.store.db import make_engine

README = Path(__file__).resolve().parent.parent / "README.md"
# the README's placeholders, and what stands for them here (fixture name, adapter name)
MODEL_PATH = "/models/llama-3.2-1b"
ADAPTER_PATH = "/adapters/sql-lora"
POLICY_PATH = "/adapters/policy"  # the in-place reload example's adapter (its training step is a comment)


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.S | re.M)


def test_the_readme_has_its_examples():
    python = blocks("python")
    engines = [b for b in python if MODEL_PATH in b]
    assert len(engines) >= 3 and any("llm.chat(" in b for b in engines) and any("AuditLog" in b for b in python)
    assert len(blocks("sql")) >= 3
    assert any(SERVER_URL in b and SERVER_KEY in b for b in python), (
        "the Serve over HTTP example, run against a live server"
    )


SERVER_URL = "http://localhost:8000/v1"
SERVER_KEY = '"ll-..."'


@pytest.fixture
def readme_server(tiny_llama_chat, tmp_path_factory):
    """The README's `loraledger serve` example: the tiny fixture, its all_r8 adapter served as "sql", one key."""
    from loraledger import EngineArgs
    from loraledger.server import LoRAModule, ServerConfig
    from loraledger.server.auth import add_key
    from tests.server.live import LiveServer

    tmp = tmp_path_factory.mktemp("readme-server")
    _, key = add_key(tmp / "keys.toml", tenant="acme", adapters=["sql"])
    args = EngineArgs(
        model=str(tiny_llama_chat.model_dir),
        enable_lora=True,
        max_lora_rank=16,
        audit_url=f"sqlite:///{tmp / 'server.db'}",
    )
    config = ServerConfig(
        engine_args=args,
        lora_modules=(LoRAModule("sql", str(tiny_llama_chat.adapters["all_r8"])),),
        api_keys_file=str(tmp / "keys.toml"),
    )
    with LiveServer(config) as server:
        yield {SERVER_URL: f"{server.base_url}/v1", SERVER_KEY: repr(key)}


def test_every_python_and_sql_example_runs_twice(tiny_llama_chat, tmp_path, monkeypatch, capsys, readme_server):
    """Each block on its own (its own imports and names), in the README's order, in a folder of its own
    (the examples' `sqlite:///audit.db` lands there); then every SQL example against that audit database.
    The model is the tiny fixture with a chat template (the chat example renders with it)."""
    tiny_llama = tiny_llama_chat
    monkeypatch.chdir(tmp_path)
    substitutes = {
        MODEL_PATH: str(tiny_llama.model_dir),
        ADAPTER_PATH: str(tiny_llama.adapters["all_r8"]),
        POLICY_PATH: str(tiny_llama.adapters["qv_r4"]),
        **readme_server,
    }
    for run in (1, 2):
        for i, source in enumerate(blocks("python")):
            for placeholder, path in substitutes.items():
                source = source.replace(placeholder, path)
            try:
                exec(compile(source, f"README.md python example {i + 1}", "exec"), {"__name__": "__main__"})
            except Exception as exc:
                pytest.fail(f"README python example {i + 1}, run {run}: {type(exc).__name__}: {exc}")
    assert "Traceback" not in capsys.readouterr().err
    engine = make_engine(f"sqlite:///{tmp_path / 'audit.db'}")
    try:
        with engine.connect() as conn:
            for source in blocks("sql"):
                for statement in (s for s in source.split(";") if s.strip() and not _only_comments(s)):
                    conn.execute(text(statement)).fetchall()
            requests = conn.execute(text("SELECT count(*) FROM requests")).scalar_one()
    finally:
        engine.dispose()
    # per run: two from LLM.generate, two from LLM.chat, one from LLMEngine, one from AsyncEngine, three from the
    # in-place reload loop, three structured
    assert requests == 2 * 12


def _only_comments(statement: str) -> bool:
    return all(not line.strip() or line.strip().startswith("--") for line in statement.splitlines())


# the long checks the suite runs a short version of, each a command of its own
LONG_CHECKS = ("tests.gpu.nvcc_builds", "tests.stress.soak", "tests.audit.bulk_export", "tests.audit.large_n")


def test_the_long_checks_are_commands_the_readme_names():
    readme = README.read_text()
    for module in LONG_CHECKS:
        assert f"python -m {module}" in readme, f"README's testing section does not name python -m {module}"
        source = README.parent.joinpath(*module.split(".")).with_suffix(".py").read_text()
        assert 'if __name__ == "__main__":' in source, f"{module} does not run as a command"
