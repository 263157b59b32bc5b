"""A log holding one request with a large n, and the peak memory of verify and of the exports over it.

The request's request_finished event has the payload engines before the digest-only payload
wrote: one finish reason per completion, a list that grows with n (old logs keep it; verify must
still read them in bounded memory). Run as a script to print the figures:

    python -m tests.audit.large_n --n 5000 [--url URL]

It imports nothing from the test suite, so the same file measures an older checkout too (put
that checkout's package first on PYTHONPATH and run it by its path).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import msgspec

from loraledger.audit import AuditLog
from loraledger.audit.report import write_report
from loraledger.digests import binding_digest, completions_digest
from loraledger.store.audit_store import AuditStore
from loraledger.store.records import AdapterRecord, AuditBatch, CompletionRecord, EventKind, EventRecord, RequestRecord

START = 1_795_305_600.0  # 2026-11-22T00:00:00Z
BASE_FP = hashlib.sha256(b"tiny-base-model").hexdigest()
ADAPTER = AdapterRecord(
    fingerprint=hashlib.sha256(b"adapter-bulk").hexdigest(), name="bulk", int_id=1, path="/adapters/bulk", rank=8,
    alpha=16.0, target_modules=["q_proj", "v_proj"], base_model_fingerprint=BASE_FP, first_seen=START,
)  # fmt: skip
PROMPT = "Summarise the master services agreement in plain words, clause by clause. " * 20  # ~1.5 kB


def build(url: str, n: int) -> str:
    """Write one request with n completions (and one small request) to the log at url; the big one's id."""
    rid = f"large-n-{n}"
    binding = RequestRecord(
        request_id=rid, adapter_fingerprint=ADAPTER.fingerprint, lora_name=ADAPTER.name, lora_int_id=1,
        lora_path=ADAPTER.path, tenant="acme", sampling_params={"n": n, "temperature": 0.8, "max_tokens": 16},
        prompt_text=PROMPT, prompt_sha256=hashlib.sha256(PROMPT.encode()).hexdigest(), prompt_token_count=300,
        received_at=START + 10, engine_version="0.1.0", base_model_fingerprint=BASE_FP,
    )  # fmt: skip
    completions = [
        CompletionRecord(
            request_id=rid,
            index=i,
            text=f"answer {i}: the supplier delivers on time and fixes defects within thirty days",
            token_ids=[(i + k) % 32000 for k in range(16)],
            cumulative_logprob=-1.5 - i / n,
            finish_reason="length",
            stop_reason=None,
            adapter_fingerprint=ADAPTER.fingerprint,
            prompt_token_count=300,
            generated_token_count=16,
            first_token_at=START + 10.5,
            finished_at=START + 12,
        )  # fmt: skip
        for i in range(n)
    ]
    events = [
        EventRecord(kind=EventKind.ENGINE_STARTED, at=START, payload={}),
        EventRecord(
            kind=EventKind.REQUEST_ADMITTED, at=START + 10, request_id=rid, dedup_key=f"admit:{rid}",
            payload={"binding": msgspec.to_builtins(binding), "binding_sha256": binding_digest(binding)},
        ),
        EventRecord(
            kind=EventKind.REQUEST_FINISHED, at=START + 12, request_id=rid, dedup_key=f"end:{rid}",
            payload={
                "completions_sha256": completions_digest(completions), "num_completions": n,
                "finish_reasons": ["length"] * n,  # what engines wrote before the digest-only payload
                "num_preemptions": 0,
            },
        ),
    ]  # fmt: skip
    with AuditStore(url) as store:
        store.write(AuditBatch(adapters=[ADAPTER], requests=[binding], completions=completions, events=events))
    return rid


def peak(fn: Callable[[], Any]) -> tuple[Any, int, float]:
    """(fn's result, peak traced Python memory in bytes while it ran, seconds)."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        result = fn()
        _, top = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, top, time.perf_counter() - started


def measure(url: str, out: Path) -> dict[str, tuple[Any, int, float]]:
    """Peak memory of verify, of report bundles in CSV and JSONL (each verifies too, and writes the HTML page),
    and of `audit requests --format csv|jsonl`."""
    from loraledger.cli import main

    figures: dict[str, tuple[Any, int, float]] = {}
    with AuditLog(url) as log:
        figures["verify"] = peak(log.verify)
        for fmt in ("csv", "jsonl"):
            bundle = lambda: write_report(  # noqa: E731
                log, out / fmt, since=START, until=START + 86_400, fmt=fmt, progress=False, unsigned=True
            )
            figures[f"report_{fmt}"] = peak(bundle)

    for fmt in ("csv", "jsonl"):

        def listing() -> int:
            with redirect_stdout(io.StringIO()):
                return main(["audit", "requests", "--url", url, "--format", fmt])

        figures[f"requests_{fmt}"] = peak(listing)
    return figures


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--url", help="an empty audit database (default: a new SQLite file)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or f"sqlite:///{Path(tmp) / 'audit.sqlite3'}"
        if args.url is None:
            AuditStore(url).open().close()  # a new file gets its schema
        started = time.perf_counter()
        build(url, args.n)
        print(f"n={args.n}: log written in {time.perf_counter() - started:.1f} s")
        for name, (_, top, seconds) in measure(url, Path(tmp) / "report").items():
            print(f"{name:>14}: peak {top / 1e6:8.1f} MB traced, {seconds:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
