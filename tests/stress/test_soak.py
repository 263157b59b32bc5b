"""The short soak: resident memory stays flat over thousands of concurrent requests (the full one: python -m tests.stress.soak)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.stress.zygote import REPO_ROOT

# measured on the 2-core reference machine, 1,000 warm-up then 3,000 requests 500 at a time on the tiny
# model: +38-40 MiB (the last of the at most 185 oneDNN primitives Dense's row sizes need being
# compiled), against +404 MiB before Dense bounded the row counts reaching oneDNN
MAX_GROWTH_MIB = 100


def test_resident_memory_stays_flat_over_thousands_of_requests(tiny_llama):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    )
    argv = [
        sys.executable,
        "-m",
        "tests.stress.soak",
        "--model",
        str(tiny_llama.model_dir),
        "--warmup",
        "1000",
        "--requests",
        "3000",
        "--concurrency",
        "500",
        "--max-growth-mib",
        str(MAX_GROWTH_MIB),
    ]
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    summary = [line for line in done.stdout.splitlines() if line.startswith(("round", "resident"))]
    assert done.returncode == 0, "\n".join(summary) or done.stderr[-3000:]
