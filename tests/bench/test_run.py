"""bench.run: the one entry point reaches every benchmark, and bench/README.md's table lists each of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import run

BENCH = Path(run.__file__).resolve().parent
# modules that are no benchmark of their own: the scenarios' parts and their shared helpers
SUPPORT = {
    "__init__",
    "run",
    "bench_assets",
    "workload",
    "offline_engine",
    "hf_baseline",
    "stats",
    "patching",
    "throughput",
    "serving",
    "churn",
    "affinity_sim",
    "engine_worker",  # vs_vllm_cpu's engine process
    "vllm_cpu_env",  # vs_vllm_cpu's venv of vLLM's CPU build
    "vs_vllm_server",  # vs_vllm_cpu's server path and memory figures
    "salted_text",  # the evidence bench's writer with and without salted text
    "kernels_quant",
    "gpu_quant_step",  # gpu_step --quant: W4A16 against bf16 dense
    "quant_vllm",  # quant's vLLM column
}


def test_every_module_is_a_listed_benchmark_or_a_part_of_one():
    listed = {b.module.removeprefix("bench.") for b in run.CATALOGUE if b.module}
    modules = {p.stem for p in BENCH.glob("*.py")}
    assert modules == listed | SUPPORT, (
        "a bench module that no `python -m bench.run --only NAME` reaches, or a listed one that is gone"
    )


def test_the_readme_table_lists_every_benchmark_with_its_command():
    readme = (BENCH / "README.md").read_text()
    for b in run.CATALOGUE:
        assert f"| `{b.name}` |" in readme, f"bench/README.md's table has no row for {b.name}"
        assert f"python -m bench.run --only {b.name}" in readme


def test_list_prints_the_catalogue(capsys):
    assert run.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"python -m bench.run --only {b.name}" in out for b in run.CATALOGUE)


def test_a_benchmark_that_runs_alone_gets_its_own_options(capsys):
    assert run.main(["--only", "dense", "--rows", "1", "--repeats", "1", "--iters", "1"]) == 0
    assert "lm_head" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="runs alone"):
        run.main(["--only", "dense", "--only", "throughput"])
    for name in run.ALONE:
        with pytest.raises(SystemExit) as exit_:
            run.main([f"--only={name}", "--help"])
        assert exit_.value.code == 0
        assert "usage:" in capsys.readouterr().out
