"""What salted text costs: with text inline in the chain-covered rows (as before revision 0013) vs kept in
`request_texts` under salted commitments (as the engine writes now), for the writer alone (group commits of finished
requests) and for the CPU bench engine end to end (batch-32 tokens/s).

Run by `python -m bench.run --only evidence` (bench/evidence.py): alternating rounds, one SQLite file per mode, the
median of each and the per-round ratios.
"""

from __future__ import annotations

import contextlib
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


class InlineText:
    """While entered, the engine writes text as before revision 0013: no salt drawn, no commitment hashed, no
    `request_texts` row; each text goes into the chain-covered column that held it (prompt_text, completions.text and
    token_ids, tools_text, constraint_text, tool_calls). The events' digests are taken over the rows as the actors
    made them (text empty), which costs the same bytes to within the text's length; nothing is verified here."""

    def __enter__(self) -> InlineText:
        import msgspec

        from loraledger.actors import admission, output_assembler
        from loraledger.store import texts
        from loraledger.store.audit_store import AuditStore
        from loraledger.store.records import TextRecord

        # the actors bind the record makers by name: patched where they call them
        self._patched = [(m, n, getattr(m, n)) for m in (admission, output_assembler)
                         for n in ("salted_text", "text_commitments", "salted_content") if hasattr(m, n)]  # fmt: skip
        self._store, self._write = AuditStore, AuditStore.write
        real_write = AuditStore.write

        def salted(request_id, part, index, text, token_ids):
            return TextRecord(
                request_id=request_id, part=part, index=index, salt="", text=text, token_ids=list(token_ids)
            )

        def inline(store, batch, receipts=None):
            by = {(t.request_id, t.part, t.index): t for t in batch.texts}
            requests = []
            for r in batch.requests:
                kept = {p: by.get((r.request_id, p, 0)) for p in (texts.PROMPT, texts.TOOLS, texts.CONSTRAINT)}
                requests.append(msgspec.structs.replace(
                    r, **{name: kept[p].text for p, name in ((texts.PROMPT, "prompt_text"), (texts.TOOLS, "tools_text"),
                                                              (texts.CONSTRAINT, "constraint_text")) if kept[p]}))  # fmt: skip
            completions = []
            for c in batch.completions:
                row, calls = (
                    by.get((c.request_id, texts.COMPLETION, c.index)),
                    by.get((c.request_id, texts.TOOL_CALLS, c.index)),
                )
                fields = {} if row is None else {"text": row.text, "token_ids": row.token_ids}
                completions.append(msgspec.structs.replace(c, tool_calls=calls.text if calls else None, **fields))
            moved = msgspec.structs.replace(batch, requests=requests, completions=completions, texts=[])
            return real_write(store, moved, receipts)

        fakes = {
            "salted_text": salted,
            "text_commitments": lambda record: (None, None),
            "salted_content": lambda rid, part, index, text: (salted(rid, part, index, text, []), None),
        }
        for module, name, _ in self._patched:
            setattr(module, name, fakes[name])
        AuditStore.write = inline
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, real in self._patched:
            setattr(module, name, real)
        self._store.write = self._write


def engine_rounds(folder: Path, rounds: int, threads: int) -> dict[str, object]:
    """Batch-32 tokens/s of the CPU bench engine (32 x 32 tokens over 8 adapters, receipts and tree on) writing text
    inline vs salted, alternating rounds, each engine on a SQLite file of its own; medians and per-round ratios."""
    import torch

    from bench.bench_assets import model_assets
    from bench.offline_engine import OfflineEngine
    from bench.workload import batch_workload
    from loraledger import SamplingParams

    torch.set_num_threads(threads)
    assets = model_assets()
    work = batch_workload(1, num_prompts=32, prompt_len=64, max_tokens=32, vocab_size=assets.vocab_size, num_adapters=8)
    modes = ("text inline (before)", "salted commitments")
    runs: dict[str, list[float]] = {m: [] for m in modes}
    engines: dict[str, OfflineEngine] = {}
    urls = {mode: f"sqlite:///{folder / f'salted_engine{i}.sqlite3'}" for i, mode in enumerate(modes)}
    try:
        for i, mode in enumerate(modes):
            with InlineText() if i == 0 else contextlib.nullcontext():
                engines[mode] = OfflineEngine(
                    assets.model_dir, assets.adapters, num_threads=threads, audit_url=urls[mode]
                )
                engines[mode].register_all()
        prompts = [{"prompt_token_ids": p} for p in work.prompts]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.max_tokens]
        for r in range(rounds + 1):  # round 0 warms up
            for i, (mode, engine) in enumerate(engines.items()):
                loras = [None if a is None else engine.loras[a] for a in work.adapter_of]
                with InlineText() if i == 0 else contextlib.nullcontext():
                    started = time.perf_counter()
                    outs = engine.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
                    seconds = time.perf_counter() - started
                if r:
                    runs[mode].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    finally:
        for engine in engines.values():
            engine.close()
    kept = {mode: _kept_rows(url) for mode, url in urls.items()}
    assert kept["text inline (before)"] == 0 < kept["salted commitments"], kept  # each mode wrote as it says
    out: dict[str, object] = {mode: statistics.median(r) for mode, r in runs.items()}
    out["round ratios"] = [b / a for a, b in zip(runs[modes[0]], runs[modes[1]])]
    return out


def _kept_rows(url: str) -> int:
    """How many `request_texts` rows a log holds."""
    from sqlalchemy import func, select

    from loraledger.store.db import make_engine
    from loraledger.store.texts import TEXTS

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(TEXTS)).scalar_one())
    finally:
        engine.dispose()
