"""Structured outputs: `python -m bench.structured` — what constraints cost the batch, and which grammar engine serves it.

1. Engine: the throughput scenario's batch (32 prompts of 64 ids, 32 new tokens, 8 adapters + base) on
   the CPU bench model, every request constrained to a JSON schema against none; tokens/s medians of
   alternating rounds and their ratio (constrained / unconstrained). The schema's strings are free,
   so the random model writes inside them up to max_tokens: both sides generate the same number of tokens.
2. Grammar engines (xgrammar, llguidance) on their own: compile time of the schema, and the time to
   fill one step's token bitmask for 32 matchers, at three vocabulary sizes: the test fixture's
   (512), the bench model's (32k) and a synthetic byte-level 150k one (a Qwen/Llama-3-sized vocabulary,
   built offline). The matchers advance by the argmax of random logits under their masks, as a sampler would.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "email", "address"],
}
BATCH = 32


# -- 1. the engine ------------------------------------------------------------------------------


def engine_ratio(rounds: int, threads: int, log=print) -> dict:
    from bench.bench_assets import model_assets
    from bench.offline_engine import OfflineEngine
    from bench.workload import batch_workload
    from loraledger import SamplingParams
    from loraledger.sampling_params import StructuredOutputsParams

    torch.set_num_threads(threads)
    assets = model_assets()
    work = batch_workload(
        1, num_prompts=BATCH, prompt_len=64, max_tokens=32, vocab_size=assets.vocab_size, num_adapters=8
    )
    engine = OfflineEngine(assets.model_dir, assets.adapters, num_threads=threads)
    so = StructuredOutputsParams(json=SCHEMA)
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    loras = [None if a is None else engine.loras[a] for a in work.adapter_of]
    params = {
        "none": [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.max_tokens],
        "all": [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=so) for n in work.max_tokens
        ],
    }
    runs: dict[str, list[float]] = {"none": [], "all": []}
    finished_by_grammar = 0
    try:
        engine.register_all()
        for mode in runs:  # warm-up: adapters in their slots, the grammar compiled
            engine.llm.generate(prompts, params[mode], lora_request=loras, use_tqdm=False)
        for r in range(rounds):
            for mode in runs:
                started = time.perf_counter()
                outs = engine.llm.generate(prompts, params[mode], lora_request=loras, use_tqdm=False)
                seconds = time.perf_counter() - started
                runs[mode].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
                if mode == "all":
                    finished_by_grammar += sum(o.outputs[0].finish_reason == "stop" for o in outs)
            log(f"round {r}: none {runs['none'][-1]:.0f} tok/s, all constrained {runs['all'][-1]:.0f} tok/s")
    finally:
        engine.close()
    none, constrained = statistics.median(runs["none"]), statistics.median(runs["all"])
    return {
        "tokens_per_second": runs,
        "median_none": none,
        "median_all": constrained,
        "all_over_none": constrained / none,
        "finished_by_grammar": finished_by_grammar,
    }


# -- 2. the grammar engines ----------------------------------------------------------------------


def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of `vocab_size` tokens (256 bytes, </s>, and random words with and without a leading
    space), built in memory: the vocabulary is what a grammar engine's mask work depends on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"</s>": 0}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    rng = random.Random(0)
    letters = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_",:{}[]'
    while len(vocab) < vocab_size:
        word = ("Ġ" if rng.random() < 0.5 else "") + "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def _xgrammar(tokenizer, vocab: int, eos: int, steps: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(SCHEMA, any_whitespace=False)
    compile_s = time.perf_counter() - started
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    bitmask = xgr.allocate_token_bitmask(BATCH, vocab)
    batch = xgr.BatchGrammarMatcher(max_threads="auto")

    def fill() -> None:
        batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(tokens: list[int]) -> None:
        for i, (m, t) in enumerate(zip(matchers, tokens)):
            if m.is_terminated() or not m.accept_token(t):
                matchers[i] = xgr.GrammarMatcher(compiled)

    return {
        "compile_ms": 1e3 * compile_s,
        **_steps(fill, advance, bitmask, vocab, steps, xgr.apply_token_bitmask_inplace),
    }


def _llguidance(tokenizer, vocab: int, eos: int, steps: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    first = llguidance.LLMatcher(lltok, grammar)
    bitmask = lt.allocate_token_bitmask(BATCH, vocab)
    lt.fill_next_token_bitmask(first, bitmask, 0)  # llguidance compiles lazily: the first mask is part of the compile
    compile_s = time.perf_counter() - started
    matchers = [first] + [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH - 1)]
    executor = llguidance.LLExecutor()

    def fill() -> None:
        lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def advance(tokens: list[int]) -> None:
        for i, (m, t) in enumerate(zip(matchers, tokens)):
            if m.is_stopped() or not m.consume_token(t):
                matchers[i] = llguidance.LLMatcher(lltok, grammar)

    return {
        "compile_ms": 1e3 * compile_s,
        **_steps(fill, advance, bitmask, vocab, steps, lt.apply_token_bitmask_inplace),
    }


def _steps(fill, advance, bitmask, vocab: int, steps: int, apply) -> dict:
    gen = torch.Generator().manual_seed(0)
    fills, applies = [], []
    for _ in range(steps):
        logits = torch.randn(BATCH, vocab, generator=gen)
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        apply(logits, bitmask)
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        applies.append(t2 - t1)
        advance(logits.argmax(dim=-1).tolist())
    return {"fill_ms_median": 1e3 * statistics.median(fills), "apply_ms_median": 1e3 * statistics.median(applies)}


def grammar_engines(steps: int, log=print) -> dict:
    from transformers import AutoTokenizer

    from bench.bench_assets import model_assets
    from loraledger.assets import build_tokenizer

    fixture_dir = Path(__import__("tempfile").mkdtemp(prefix="bench-structured-"))
    build_tokenizer(fixture_dir, vocab_size=512)
    vocabularies = {
        "fixture-512": AutoTokenizer.from_pretrained(fixture_dir),
        "bench-32k": AutoTokenizer.from_pretrained(model_assets().model_dir),
        "synthetic-150k": synthetic_tokenizer(150_000),
    }
    report = {}
    for name, tokenizer in vocabularies.items():
        vocab = len(tokenizer)
        eos = tokenizer.eos_token_id
        report[name] = {"vocab": vocab}
        for engine, run in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
            r = run(tokenizer, vocab, eos, steps)
            report[name][engine] = r
            log(
                f"{name:<15} {engine:<10} compile {r['compile_ms']:8.1f} ms   fill (batch {BATCH}) {r['fill_ms_median']:7.3f} ms"
                f"   apply {r['apply_ms_median']:6.3f} ms"
            )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--steps", type=int, default=64, help="mask-fill steps per grammar engine and vocabulary")
    parser.add_argument("--skip-engine", action="store_true", help="only the grammar-engine comparison")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from bench.stats import environment

    report = {"environment": environment(), "grammar_engines": grammar_engines(args.steps)}
    if not args.skip_engine:
        report["engine"] = engine_ratio(args.rounds, args.threads)
        e = report["engine"]
        print(
            f"batch {BATCH}: none {e['median_none']:.0f} tok/s, all constrained {e['median_all']:.0f} tok/s: "
            f"{e['all_over_none']:.2f}x ({e['finished_by_grammar']} outputs ended by their grammar)"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
