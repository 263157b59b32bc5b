"""Many writers, one hash chain: `python -m bench.run --only audit-chain [--url URL] [--writers 1 4] [--batch 1 8]`.

Each writer is a process of its own with an AuditStore registered as an engine instance, committing
group commits the way the AuditWriter does: per request a `requests` row, its request_admitted
event, one completion and its request_finished event (2 events), `--batch` requests per commit.
Every commit takes the database's writer lock (PostgreSQL: a transaction-scoped advisory lock;
SQLite: BEGIN IMMEDIATE), reads the chain's head and appends, so writers take turns: the figure is
the events/s all writers commit together, with 1 and with N writers, and their ratio (1.0: adding
writers neither adds nor costs throughput; below 1: the hand-over of the lock costs). Afterwards the
log must verify: one gap-free chain, every instance's rows vouched for.

Default: a SQLite file in a temporary folder; `--url postgresql://...` (an empty database, or one
this benchmark may fill) for PostgreSQL, repeatable.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

SECONDS = 4.0  # each measured round
EVENTS_PER_REQUEST = 2


def _batch(prefix: str, start: int, size: int):
    """What a group commit of `size` finished requests writes, with the payloads verify checks (binding, completions digest)."""
    import msgspec

    from loraledger.digests import binding_digest, completions_digest
    from loraledger.store.records import AuditBatch, CompletionRecord, EventKind, EventRecord, RequestRecord

    now = time.time()
    requests, completions, events = [], [], []
    for i in range(start, start + size):
        rid = f"{prefix}-{i}"
        binding = RequestRecord(
            request_id=rid, adapter_fingerprint=None, lora_name=None, lora_int_id=None, lora_path=None, tenant="bench",
            sampling_params={"max_tokens": 16}, prompt_text="a prompt of a few words", prompt_sha256=hashlib.sha256(rid.encode()).hexdigest(),
            prompt_token_count=6, received_at=now, engine_version="bench", base_model_fingerprint="f" * 64,
        )  # fmt: skip
        completion = CompletionRecord(
            request_id=rid, index=0, text=" sixteen tokens of output text", token_ids=list(range(16)), cumulative_logprob=None,
            finish_reason="length", stop_reason=None, adapter_fingerprint=None, prompt_token_count=6, generated_token_count=16,
            first_token_at=now, finished_at=now,
        )  # fmt: skip
        requests.append(binding)
        completions.append(completion)
        admitted = {"binding": msgspec.to_builtins(binding), "binding_sha256": binding_digest(binding)}
        finished = {"completions_sha256": completions_digest([completion]), "num_completions": 1}
        events.append(
            EventRecord(
                kind=EventKind.REQUEST_ADMITTED, at=now, request_id=rid, payload=admitted, dedup_key=f"admitted:{rid}"
            )
        )
        events.append(
            EventRecord(
                kind=EventKind.REQUEST_FINISHED, at=now, request_id=rid, payload=finished, dedup_key=f"end:{rid}"
            )
        )
    return AuditBatch(requests=requests, completions=completions, events=events)


def _writer(url: str, prefix: str, batch: int, ready, go, stop_at, counts) -> None:
    from loraledger.store.audit_store import AuditStore
    from loraledger.store.instances import this_instance

    with AuditStore(url, timeout=30.0) as store:
        store.register(this_instance("bench", lease_seconds=600))
        store.write(_batch(prefix + "-warm", 0, batch))  # a connection made and the statements compiled: not measured
        ready.put(True)
        go.wait()
        written = 0
        while time.time() < stop_at.value:
            store.write(_batch(prefix, written, batch))
            written += batch
        store.release_lease()
    counts.put(written * EVENTS_PER_REQUEST)


def measure(url: str, writers: int, batch: int, round_id: str) -> float:
    """Events/s that `writers` processes commit together into url, over SECONDS."""
    ctx = mp.get_context("spawn")
    ready, go, counts, stop_at = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Value("d", 0.0)
    procs = [
        ctx.Process(target=_writer, args=(url, f"{round_id}-w{w}", batch, ready, go, stop_at, counts))
        for w in range(writers)
    ]
    for p in procs:
        p.start()
    for _ in procs:  # every writer has imported, registered and written once before the clock starts
        ready.get(timeout=120)
    started = time.time()
    stop_at.value = started + SECONDS
    go.set()
    total = sum(counts.get(timeout=120) for _ in procs)
    elapsed = time.time() - started
    for p in procs:
        p.join(30)
    return total / elapsed


def main(argv: list[str] | None = None) -> int:
    from loraledger.audit import AuditLog
    from loraledger.store.db import display_url
    from loraledger.store.migrate import upgrade

    parser = argparse.ArgumentParser(prog="python -m bench.run --only audit-chain", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url",
        action="append",
        default=None,
        help="an audit database to write (repeatable; default: a new SQLite file)",
    )
    parser.add_argument(
        "--writers", type=int, nargs="+", default=[1, 4], help="writer process counts to compare (default: 1 4)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="requests per group commit (default: 1 8)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per setting, median reported (default 2)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        urls = args.url or [f"sqlite:///{Path(tmp) / 'audit.sqlite3'}"]
        print(
            f"{'database':<12} {'batch':>5} "
            + " ".join(f"{f'{w} writer(s)':>13}" for w in args.writers)
            + f" {'ratio':>7}"
        )
        for url in urls:
            upgrade(url)
            dialect = "postgresql" if url.startswith("postgres") else "sqlite"
            for batch in args.batch:
                rates = []
                for w in args.writers:
                    runs = [measure(url, w, batch, f"b{batch}w{w}r{r}-{time.time_ns()}") for r in range(args.repeats)]
                    rates.append(statistics.median(runs))
                ratio = rates[-1] / rates[0]
                print(
                    f"{dialect:<12} {batch:>5} " + " ".join(f"{r:>9.0f} ev/s" for r in rates) + f" {ratio:>6.2f}x",
                    flush=True,
                )
            with AuditLog(url) as log:
                result = log.verify()
            if not result.ok:
                print(f"{display_url(url)}: the log does NOT verify: {result.problems[:3]}")
                return 1
            print(
                f"{display_url(url)}: {result.events} events from {len(log_instances(url))} instances, one chain, verified"
            )
    return 0


def log_instances(url: str) -> list:
    from loraledger.audit import AuditLog

    with AuditLog(url) as log:
        return log.instances()


if __name__ == "__main__":
    raise SystemExit(main())
