"""Small numeric helpers for the benchmark: medians, percentiles, engine-stat deltas, and which code was measured."""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ENGINE_DIRS = ("loraledger", "actors", "gpu", "store")

_COUNTERS = (
    "steps",
    "tokens",
    "sequences",
    "wall_seconds",
    "forward_seconds",
    "prepare_seconds",
    "schedule_seconds",
    "update_seconds",
    "prefix_cache_hit_tokens",
    "prefix_cache_query_tokens",
    "gpu_seconds",
    "gpu_idle_seconds",
)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 99)) -> dict[str, float]:
    """{"p50": ..., "p99": ...} in the unit of `values`; NaN when there are none."""
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q:g}": float(np.percentile(arr, q)) if arr.size else float("nan") for q in qs}


def stats_delta(before, after) -> dict[str, float]:
    """The engine's StatsSnapshot counters accumulated between two snapshots, plus the overhead fraction."""
    return _with_fractions({name: getattr(after, name) - getattr(before, name) for name in _COUNTERS})


def add_deltas(deltas: Sequence[dict[str, float]]) -> dict[str, float]:
    return _with_fractions({name: sum(d[name] for d in deltas) for name in _COUNTERS})


def _with_fractions(counters: dict[str, float]) -> dict[str, float]:
    """overhead_fraction: share of step wall time outside the step thread's forward and sampling (CPU view);
    gpu_idle_fraction (CUDA): share of the device's time between steps spent waiting for the engine."""
    wall = counters["wall_seconds"]
    counters["overhead_fraction"] = 1.0 - counters["forward_seconds"] / wall if wall > 0 else 0.0
    busy = counters["gpu_seconds"] + counters["gpu_idle_seconds"]
    counters["gpu_idle_fraction"] = counters["gpu_idle_seconds"] / busy if busy > 0 else 0.0
    return counters


def environment() -> dict[str, object]:
    """What ran: commit, uncommitted engine changes, and a hash of the engine modules actually imported.

    The hash covers the files of the already imported `loraledger*` modules (import the engine first),
    wherever they came from: an editable install can point at another checkout than this one, and
    other work may edit the tree while a run is under way.
    """
    import sys

    import torch
    import transformers

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    digest = hashlib.sha256()
    roots = set()
    for name in sorted(n for n in sys.modules if n == "loraledger" or n.startswith("loraledger.")):
        path = getattr(sys.modules[name], "__file__", None)
        if not path:
            continue
        source = Path(path)
        digest.update(name.encode())
        digest.update(source.read_bytes())
        if name.count(".") <= 2:  # loraledger.x / loraledger.gpu.x live one folder below their checkout's root
            roots.add(str(source.parents[1]))
    outside = sorted(r for r in roots if not Path(r).resolve().is_relative_to(ROOT))
    return {
        "commit": git("rev-parse", "HEAD"),
        "engine_files_changed_since_commit": git("status", "--porcelain", "--", *ENGINE_DIRS).splitlines(),
        "engine_modules_sha256": digest.hexdigest(),
        "engine_module_roots": sorted(roots),
        "engine_imported_from_elsewhere": outside,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
    }
