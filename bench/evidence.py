"""What evidence costs: `python -m bench.run --only evidence [--leaves 1000000] [--batch 32] [--seconds 3]`.

0. The engine: batch-32 tokens/s on the CPU bench model with the audit log's chain alone vs with the tree and
   receipts (alternating rounds; --skip-engine leaves it out).
1. The writer: group commits of --batch finished requests (the rows and events bench.audit_chain writes)
   with the chain alone, with the Merkle tree, and with the tree and a signed receipt per request,
   alternating rounds on one SQLite file; requests/s of each and the ratio to the chain alone.
2. Salted text (bench/salted_text.py): the engine's batch-32 tokens/s (unless --skip-engine) and the same writer
   with text inline in the chain-covered rows (before revision 0013) vs in `request_texts` under salted
   commitments, alternating rounds; tokens/s or requests/s and per-round ratios.
3. The tree at --leaves leaves (default 10^6, built in `merkle_nodes` of a fresh SQLite file): the append
   rate of 32-leaf batches at that size, a signed checkpoint's time, and inclusion and consistency proofs:
   size in hashes and bytes, time to read one from the store and to verify it (medians over 200 random ones).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench import salted_text


def _writer_rounds(folder: Path, batch: int, seconds: float, rounds: int) -> dict[str, float]:
    """requests/s of each mode, each on a SQLite file of its own (a log written without the tree has no tree to extend)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from bench.audit_chain import _batch
    from loraledger.evidence import node_store
    from loraledger.evidence.log_key import LogKey
    from loraledger.store.audit_store import AuditStore
    from loraledger.store.migrate import upgrade

    key = LogKey(Ed25519PrivateKey.generate(), "bench.example/log")
    real_append = node_store.append_leaves
    modes = {"chain only": (False, False), "chain + tree": (True, False), "chain + tree + receipts": (True, True)}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    stores = {}
    for i, (mode, (_, receipts)) in enumerate(modes.items()):
        url = f"sqlite:///{folder / f'writer{i}.sqlite3'}"
        upgrade(url)
        stores[mode] = AuditStore(url, timeout=30.0).open()
        stores[mode].log_key = key if receipts else None
    try:
        counter = 0
        for _ in range(rounds + 1):  # the first round warms up (connections, statements): not counted
            for mode, (tree, _) in modes.items():
                node_store.append_leaves = real_append if tree else (lambda conn, first, hashes: None)
                done, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    stores[mode].write(_batch(f"r{counter}", done, batch))
                    done += batch
                rates[mode].append(done / (time.perf_counter() - start))
                counter += 1
    finally:
        node_store.append_leaves = real_append
        for store in stores.values():
            store.close()
    medians = {m: statistics.median(r[1:]) for m, r in rates.items()}
    base = rates["chain only"][1:]
    for mode in ("chain + tree", "chain + tree + receipts"):
        ratios = [b / a for a, b in zip(base, rates[mode][1:])]
        print(f"  {mode}: per-round ratios to the chain alone {' '.join(f'{r:.2f}' for r in ratios)}")
    return medians


def engine_ratio(folder: Path, rounds: int, threads: int) -> dict[str, float]:
    """Batch-32 tokens/s of the CPU bench engine writing its audit log with the chain alone vs with the Merkle tree and
    a signed receipt per request, alternating rounds (each engine on a database of its own)."""
    import torch

    from bench.bench_assets import model_assets
    from bench.offline_engine import OfflineEngine
    from bench.workload import batch_workload
    from loraledger import SamplingParams
    from loraledger.evidence import log_key, node_store

    torch.set_num_threads(threads)
    assets = model_assets()
    work = batch_workload(1, num_prompts=32, prompt_len=64, max_tokens=32, vocab_size=assets.vocab_size, num_adapters=8)
    real_append, real_load = node_store.append_leaves, log_key.LogKey.load
    engines: dict[str, OfflineEngine] = {}
    runs: dict[str, list[float]] = {"chain only": [], "tree + receipts": []}

    def evidence(on: bool) -> None:
        node_store.append_leaves = real_append if on else (lambda conn, first, hashes: None)
        log_key.LogKey.load = real_load if on else classmethod(lambda cls, *a, **k: None)  # type: ignore[assignment]

    try:
        for i, mode in enumerate(runs):
            evidence(mode != "chain only")
            engines[mode] = OfflineEngine(assets.model_dir, assets.adapters, num_threads=threads,
                                          audit_url=f"sqlite:///{folder / f'engine{i}.sqlite3'}")  # fmt: skip
            engines[mode].register_all()
        prompts = [{"prompt_token_ids": p} for p in work.prompts]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.max_tokens]
        for r in range(rounds + 1):  # round 0 warms up
            for mode, engine in engines.items():
                evidence(mode != "chain only")
                loras = [None if a is None else engine.loras[a] for a in work.adapter_of]
                started = time.perf_counter()
                outs = engine.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
                seconds = time.perf_counter() - started
                if r:
                    runs[mode].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
                    assert all((o.receipt is not None) == (mode != "chain only") for o in outs)
    finally:
        for mode, engine in engines.items():
            evidence(mode != "chain only")
            engine.close()
        evidence(True)
    result = {mode: statistics.median(r) for mode, r in runs.items()}
    # each round's ratio of two runs next to each other in time: steadier than a ratio of medians on a busy machine
    result["round ratios"] = [b / a for a, b in zip(runs["chain only"], runs["tree + receipts"])]
    return result


def _build_tree(url: str, leaves: int) -> float:
    """leaves synthetic leaves in merkle_nodes (no events: the tree alone); returns leaves/s of the build."""
    import hashlib

    from loraledger.evidence import node_store
    from loraledger.store.db import make_engine

    engine = make_engine(url)
    start, chunk = time.perf_counter(), 20_000
    with engine.begin() as conn:
        for first in range(0, leaves, chunk):
            n = min(chunk, leaves - first)
            node_store.append_leaves(
                conn, first, [hashlib.sha256(i.to_bytes(8, "big")).hexdigest() for i in range(first, first + n)]
            )
    engine.dispose()
    return leaves / (time.perf_counter() - start)


def _tree_figures(url: str, leaves: int, batch: int) -> dict[str, float]:
    import hashlib

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from loraledger.evidence import node_store
    from loraledger.evidence import tree_hash as th
    from loraledger.evidence.log_key import LogKey
    from loraledger.evidence.signed_note import Note
    from loraledger.evidence.tlog_checkpoint import Checkpoint
    from loraledger.store.db import make_engine

    rng = random.Random(0)
    engine = make_engine(url)
    out: dict[str, float] = {}
    with engine.connect() as conn:
        n = node_store.size(conn)
        root = node_store.root(conn, n)
        # appends at this size: batch leaves per commit, as the writer does
        times = []
        for k in range(20):
            hashes = [hashlib.sha256(f"more {k} {i}".encode()).hexdigest() for i in range(batch)]
            conn.rollback()  # each append in a transaction of its own, rolled back: the tree stays at n
            start = time.perf_counter()
            node_store.append_leaves(conn, n, hashes)
            times.append(time.perf_counter() - start)
            conn.rollback()
        out["append ms / batch"] = statistics.median(times) * 1e3
        out["append leaves/s"] = batch / statistics.median(times)
        key = LogKey(Ed25519PrivateKey.generate(), "bench.example/log")
        start = time.perf_counter()
        for _ in range(50):
            text = Checkpoint(key.origin, n, node_store.root(conn, n)).text()
            Note(text, [key.sign_note(text)]).render()
        out["checkpoint ms"] = (time.perf_counter() - start) / 50 * 1e3
        read, check, sizes = [], [], []
        for _ in range(200):
            leaf = rng.randrange(n)
            start = time.perf_counter()
            proof = node_store.inclusion_proof(conn, leaf, n)
            read.append(time.perf_counter() - start)
            leaf_hash = node_store.leaf_of_event(hashlib.sha256(leaf.to_bytes(8, "big")).hexdigest())
            start = time.perf_counter()
            assert th.verify_inclusion(leaf_hash, leaf, n, proof, root)
            check.append(time.perf_counter() - start)
            sizes.append(len(proof))
        out["inclusion hashes"] = statistics.median(sizes)
        out["inclusion bytes"] = statistics.median(sizes) * 32
        out["inclusion read ms"] = statistics.median(read) * 1e3
        out["inclusion verify ms"] = statistics.median(check) * 1e3
        read, check, sizes = [], [], []
        for _ in range(200):
            old = rng.randrange(1, n)
            start = time.perf_counter()
            proof = node_store.consistency_proof(conn, old, n)
            old_root = node_store.root(conn, old)
            read.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert th.verify_consistency(old, old_root, n, root, proof)
            check.append(time.perf_counter() - start)
            sizes.append(len(proof))
        out["consistency hashes"] = statistics.median(sizes)
        out["consistency bytes"] = statistics.median(sizes) * 32
        out["consistency read ms"] = statistics.median(read) * 1e3
        out["consistency verify ms"] = statistics.median(check) * 1e3
    engine.dispose()
    return out


def main(argv: list[str] | None = None) -> int:
    from loraledger.store.migrate import upgrade

    parser = argparse.ArgumentParser(prog="python -m bench.run --only evidence", description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=1_000_000, help="tree size for the proof figures (default 10^6)")
    parser.add_argument("--batch", type=int, default=32, help="finished requests per group commit (default 32)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per writer round (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating writer rounds, median reported (default 3)")
    parser.add_argument("--skip-engine", action="store_true", help="skip the batch-32 engine tokens/s comparison")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the engine comparison (default 2)")
    parser.add_argument("--salted-only", action="store_true", help="only the salted text vs text inline comparisons")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_engine and not args.salted_only:
            tokens = engine_ratio(Path(tmp), args.rounds, args.threads)
            base = tokens["chain only"]
            print(
                f"engine, batch 32 x 32 tokens, 8 adapters (CPU, {args.threads} threads, median of {args.rounds} alternating rounds)"
            )
            ratios = tokens.pop("round ratios")
            for mode, rate in tokens.items():
                print(f"  {mode:<26} {rate:9.1f} tokens/s  {rate / base:5.2f}x")
            print(f"  per-round ratios {' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}x")
        if not args.salted_only:
            rates = _writer_rounds(Path(tmp), args.batch, args.seconds, args.rounds)
            base = rates["chain only"]
            print(
                f"writer, {args.batch} finished requests per group commit (SQLite, median of {args.rounds} alternating rounds)"
            )
            for mode, rate in rates.items():
                print(f"  {mode:<26} {rate:9.0f} requests/s  {rate / base:5.2f}x")
        if not args.skip_engine:
            salted_tokens = salted_text.engine_rounds(Path(tmp), args.rounds, args.threads)
            ratios = salted_tokens.pop("round ratios")
            base = salted_tokens["text inline (before)"]
            print(
                f"engine, salted text vs text inline (batch 32 x 32 tokens, 8 adapters, {args.rounds} alternating rounds)"
            )
            for mode, rate in salted_tokens.items():
                print(f"  {mode:<26} {rate:9.1f} tokens/s  {rate / base:5.2f}x")
            print(f"  per-round ratios {' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}x")
        salted, ratios = salted_text.writer_rounds(Path(tmp), args.batch, args.seconds, args.rounds)
        base = salted["text inline (before)"]
        print(f"writer, salted text vs text inline ({args.batch} per group commit, SQLite, {args.rounds} rounds)")
        for mode, rate in salted.items():
            print(f"  {mode:<26} {rate:9.0f} requests/s  {rate / base:5.2f}x")
        print(f"  per-round ratios {' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}x")
        if args.salted_only:
            return 0
        url = f"sqlite:///{Path(tmp) / 'tree.sqlite3'}"
        upgrade(url)
        built = _build_tree(url, args.leaves)
        print(f"tree of {args.leaves:,} leaves built at {built:,.0f} leaves/s")
        for name, value in _tree_figures(url, args.leaves, args.batch).items():
            print(f"  {name:<24} {value:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
