"""The command line: `loraledger demo` on its embedded default, `loraledger generate` on a user's checkpoint."""

from __future__ import annotations

from loraledger.cli import main


def test_demo_runs_a_mixed_batch_and_records_it(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    assert main(["demo", "--cache-dir", str(tmp_path / "cache"), "--audit-url", url, "--max-tokens", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["request", "id", "adapter", "fingerprint", "finish"]
    rows = lines[2:8]
    assert [r.split()[1] for r in rows] == ["(base)", "sql", "poet", "support", "sql", "(base)"]
    assert all(r.split()[3] == "length" and r.split()[4] == "4" for r in rows)
    # the two sql rows name the same adapter content
    assert rows[1].split()[2] == rows[4].split()[2] != "-"
    assert main(["audit", "verify", "--url", url]) == 0
    # built once: a second run reuses the cache
    assert main(["demo", "--cache-dir", str(tmp_path / "cache"), "--audit-url", url, "--max-tokens", "2", "--device", "cpu"]) == 0
    assert "building the demo model" not in capsys.readouterr().err


def test_generate_runs_base_and_each_adapter(tiny_llama, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    argv = ["generate", "--model", str(tiny_llama.model_dir), "--prompt", "hello world", "--max-tokens", "3", "--audit-url", url, "--max-lora-rank", "16"]
    for name, path in sorted(tiny_llama.adapters.items()):
        argv += ["--lora", f"{name}={path}"]
    assert main(argv) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [r.split()[1] for r in rows] == ["(base)", *sorted(tiny_llama.adapters)]


def test_bad_cli_input_is_a_clear_error(tiny_llama, capsys):
    assert main(["generate", "--model", str(tiny_llama.model_dir), "--prompt", "x", "--lora", "no-equals-sign", "--audit-url", "sqlite://"]) == 2
    assert "NAME=PATH" in capsys.readouterr().err
