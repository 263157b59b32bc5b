"""GrammarCompiler: constraints compiled by xgrammar against a tokenizer's vocabulary, once per distinct canonical form.

Why xgrammar rather than llguidance (measured with `python -m bench.run --only structured`, recorded
in bench/RESULTS.md, "Structured outputs"): filling one step's bitmask for 32 JSON-schema matchers
takes xgrammar 0.015 ms at the fixture's 512-token vocabulary and 0.1 ms at the bench model's 32k,
at least 4x and 11x less than llguidance (two runs); at a synthetic 150k vocabulary llguidance is
ahead (2.6-3.0 against 3.6-4.8 ms), which is a few percent of a batch-32 step of a model with such
a vocabulary on this CPU, and xgrammar's kernel applied masks faster than llguidance's at every size. llguidance compiles lazily (its first mask is cheaper than xgrammar's compile at
32k and 150k), which a compile cache hides after the first request of a schema. xgrammar is also
vLLM's default backend, so a vLLM user's schema means the same grammar here.

Compiling is CPU work of milliseconds to seconds: Admission runs it in a worker thread
(anyio.to_thread), never on the event loop. The cache is a bounded LRU keyed by (tokenizer,
canonical constraint text); a compile error becomes StructuredOutputError naming the problem.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraledger.errors import StructuredOutputError
from loraledger.json_tokenizer import JsonTokenizer
from loraledger.structured_outputs.constraints import MAX_JSON_WHITESPACE, Constraint

if TYPE_CHECKING:  # imported where a constraint is compiled: an engine that never sees one never loads xgrammar
    import xgrammar as xgr


@dataclass(frozen=True)
class CompiledConstraint:
    """What the runner needs to constrain one sequence: the compiled grammar; kind and digest for the record."""

    kind: str
    sha256: str
    grammar: xgr.CompiledGrammar

    def matcher(self) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.grammar)


class GrammarCompiler:
    """Compiles constraints for the engine's vocabulary; thread-safe (Admission calls it from worker threads)."""

    def __init__(
        self, vocab_size: int, stop_token_ids: tuple[int, ...], *, max_cached: int = 256, max_tokenizers: int = 16
    ) -> None:
        self._vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's vocabulary)
        self._stop = list(stop_token_ids)
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._max_tokenizers = max_tokenizers  # the model's and the adapters' own tokenizers, most recently used
        self._compilers: OrderedDict[int, tuple[object, xgr.GrammarCompiler]] = (
            OrderedDict()
        )  # id(tokenizer) -> (tokenizer, compiler)
        self._cache: OrderedDict[tuple[int, str], CompiledConstraint] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses), for tests and stats

    def compile(self, constraint: Constraint, tokenizer) -> CompiledConstraint:
        """The compiled grammar of `constraint` for `tokenizer`'s vocabulary, from the cache when it was compiled before."""
        compiler = self._compiler(tokenizer)
        key = (id(tokenizer), constraint.canonical)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = CompiledConstraint(constraint.kind, constraint.sha256, _compile(compiler, constraint))
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _compiler(self, tokenizer) -> xgr.GrammarCompiler:
        with self._lock:
            known = self._compilers.get(id(tokenizer))
            if known is not None and known[0] is tokenizer:
                self._compilers.move_to_end(id(tokenizer))
                return known[1]
        import xgrammar as xgr

        # xgrammar reads a transformers tokenizer (its class tells it the vocabulary's encoding); a JsonTokenizer
        # hands over the AutoTokenizer of its folder
        hf = tokenizer.transformers_tokenizer() if isinstance(tokenizer, JsonTokenizer) else tokenizer
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self._vocab_size, stop_token_ids=self._stop or None)
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # our cache is the bounded one
        with self._lock:
            self._compilers[id(tokenizer)] = (tokenizer, compiler)  # holds the tokenizer: its id stays unique
            while len(self._compilers) > self._max_tokenizers:
                gone, _ = self._compilers.popitem(last=False)
                for key in [k for k in self._cache if k[0] == gone]:  # an id may be reused by a later tokenizer
                    del self._cache[key]
        return compiler


def _compile(compiler: xgr.GrammarCompiler, c: Constraint) -> xgr.CompiledGrammar:
    try:
        match c.kind:
            case "json":
                return compiler.compile_json_schema(
                    c.spec, any_whitespace=c.any_whitespace, max_whitespace_cnt=_whitespace(c)
                )
            case "json_object":
                return compiler.compile_json_schema(
                    {"type": "object"},
                    any_whitespace=c.any_whitespace,
                    strict_mode=False,
                    max_whitespace_cnt=_whitespace(c),
                )
            case "regex":
                return compiler.compile_regex(c.spec)
            case "choice":
                return compiler.compile_grammar(_choice_grammar(c.spec))
            case "grammar":
                return compiler.compile_grammar(c.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise StructuredOutputError(
            f"the {c.kind} constraint (sha256 {c.sha256[:12]}) does not compile: {_first_line(exc)}; fix it and send the request again"
        ) from None
    raise StructuredOutputError(f"unknown structured-outputs kind {c.kind!r}")


def _whitespace(c: Constraint) -> int | None:
    return MAX_JSON_WHITESPACE if c.any_whitespace else None


def _choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the choices (each a JSON-escaped string literal)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before its message


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = _SOURCE_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    return text if len(text) <= 500 else text[:500] + "..."
