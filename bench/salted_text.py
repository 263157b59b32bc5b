"""What salted text costs the writer: group commits of finished requests with text inline in the chain-covered rows
(as before revision 0013) vs kept in `request_texts` under salted commitments (as the engine writes now).

Run by `python -m bench.run --only evidence` (bench/evidence.py): alternating rounds, one SQLite file per mode, the
median requests/s of each and the per-round ratios.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def salted(batch):
    """The batch as the engine writes it now: each prompt and completion in a text row under a salt."""
    import msgspec

    from loraledger.digests import binding_digest, completions_digest
    from loraledger.store.records import COMPLETION, PROMPT, EventKind, salted_text, text_commitments

    kept, requests, completions = [], [], []
    for r in batch.requests:
        row = salted_text(r.request_id, PROMPT, 0, r.prompt_text, list(range(r.prompt_token_count)))
        text_c, ids_c = text_commitments(row)
        kept.append(row)
        requests.append(
            msgspec.structs.replace(r, prompt_text=None, prompt_commitment=text_c, prompt_token_ids_commitment=ids_c)
        )
    for c in batch.completions:
        row = salted_text(c.request_id, COMPLETION, c.index, c.text, c.token_ids)
        text_c, ids_c = text_commitments(row)
        kept.append(row)
        completions.append(
            msgspec.structs.replace(c, text="", token_ids=[], text_commitment=text_c, token_ids_commitment=ids_c)
        )
    by_id = {r.request_id: r for r in requests}
    done = {c.request_id: c for c in completions}
    events = []
    for e in batch.events:
        if e.kind == EventKind.REQUEST_ADMITTED:
            b = by_id[e.request_id]
            e = msgspec.structs.replace(
                e, payload={"binding": msgspec.to_builtins(b), "binding_sha256": binding_digest(b)}
            )
        else:
            e = msgspec.structs.replace(
                e, payload={"completions_sha256": completions_digest([done[e.request_id]]), "num_completions": 1}
            )
        events.append(e)
    return msgspec.structs.replace(batch, requests=requests, completions=completions, events=events, texts=kept)


def writer_rounds(folder: Path, batch: int, seconds: float, rounds: int) -> tuple[dict[str, float], list[float]]:
    """requests/s of each mode (median of rounds after a warm-up) and the per-round ratios salted / inline."""
    from bench.audit_chain import _batch
    from loraledger.store.audit_store import AuditStore
    from loraledger.store.migrate import upgrade

    modes = {"text inline (before)": False, "salted commitments": True}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    stores = {}
    for i, mode in enumerate(modes):
        url = f"sqlite:///{folder / f'salted{i}.sqlite3'}"
        upgrade(url)
        stores[mode] = AuditStore(url, timeout=30.0).open()
    try:
        counter = 0
        for _ in range(rounds + 1):  # the first round warms up: not counted
            for mode, salt in modes.items():
                done, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    made = _batch(f"s{counter}", done, batch)
                    stores[mode].write(salted(made) if salt else made)
                    done += batch
                rates[mode].append(done / (time.perf_counter() - start))
                counter += 1
    finally:
        for store in stores.values():
            store.close()
    inline, salted_rates = rates["text inline (before)"][1:], rates["salted commitments"][1:]
    return {m: statistics.median(r[1:]) for m, r in rates.items()}, [b / a for a, b in zip(inline, salted_rates)]
