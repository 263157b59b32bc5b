"""EngineArgs: every knob of the engine in one frozen, validated struct."""

from __future__ import annotations

import math
import os

import msgspec

from loraledger.errors import ConfigError

DEFAULT_AUDIT_URL = "default"  # resolved by loraledger.paths.default_audit_url(): a SQLite file in the data dir ($LORALEDGER_HOME or the user's)


class EngineArgs(msgspec.Struct, frozen=True, kw_only=True):
    """Every knob of the engine (fields below, each with a comment); checked when built (ConfigError).

    max_n bounds SamplingParams.n, the completions one request may ask for; admission refuses a
    request above it with SamplingParamsError. Its default (None) is resolved when the engine starts
    to the smallest of 128, max_num_seqs and the number of KV-cache blocks. Each of a request's
    sequences takes a seat in the running batch and needs at least one KV block of its own for what
    it generates, so a request at the limit can still run all its sequences in one step; the KV
    cache is what ties the bound to the model: a larger model (more layers, more KV heads) fits
    fewer blocks in the same kv_cache_bytes, so its default is lower. 128 (the OpenAI API's bound on
    n) caps the work and output of one request at a few hundred completions whatever the cache.
    Seats are shared between requests (actors/scheduler.py), so a request with many sequences does
    not hold back those that arrive after it. max_logprobs bounds SamplingParams.logprobs and
    prompt_logprobs (20, vLLM's default).
    """

    model: str
    tokenizer: str | None = None  # default: the model folder
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None  # KV-cache size in blocks; wins over kv_cache_bytes
    kv_cache_bytes: int | None = None  # default: enough for max_num_seqs full-length sequences, capped at 4 GiB
    enable_prefix_caching: bool = True
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # default: max_loras
    audit_url: str | None = DEFAULT_AUDIT_URL  # None: auditing off (logged as a warning)
    audit_prompts: str = "text"  # "text" | "hash" | "none"
    audit_durable: bool = True  # release a final output only after its audit rows are committed
    audit_on_failure: str = "reject"  # "reject": refuse new requests while the store is down; "block": wait for it
    audit_timeout: float = 5.0  # seconds: the deadline of each audit-store operation (connect, statements, commit);
    # a database that does not answer within it is unavailable, as if it refused the connection (audit_on_failure)
    shutdown_timeout: float = 30.0  # seconds close() waits for running work and pending audit records; then what is
    # not on record is withheld (its callers get an error) and the next start records those requests as interrupted
    resume_interrupted: bool = False
    num_threads: int | None = None  # torch intra-op threads on the CPU path; default: torch's choice
    enforce_eager: bool = False  # CUDA: never replay CUDA graphs for decode steps (every kernel launched from Python)
    # plan and launch step N+1 while step N runs, its sampled ids fed to N+1 on the device; None: on CUDA, where
    # the device then never waits for the engine's Python; off on the CPU, where a step's launch is its whole
    # computation and the overlap only adds a thread competing for the cores (0.90x-1.03x: bench.overlap)
    async_scheduling: bool | None = None
    max_n: int | None = None  # most completions per request (SamplingParams.n); None: see the class docstring
    max_logprobs: int = 20  # most top alternatives SamplingParams.logprobs / prompt_logprobs may ask for (vLLM's default)

    def __post_init__(self) -> None:
        try:
            self._check()
        except TypeError as exc:  # a comparison with a value of the wrong type
            raise ConfigError(f"an EngineArgs value has the wrong type ({exc}); see loraledger.EngineArgs for each field's type") from exc

    def _check(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ConfigError(message)

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras", "max_lora_rank", "seed", "max_logprobs"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an integer, got {value!r}")

        need(isinstance(self.model, (str, os.PathLike)) and str(self.model) != "", "EngineArgs.model must name a model folder")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        need(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        need(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), f"block_size must be a power of two in 1..128, got {self.block_size}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1")
        need(self.kv_cache_bytes is None or self.kv_cache_bytes >= 1, "kv_cache_bytes must be >= 1")
        need(self.max_loras >= 1, "max_loras must be >= 1")
        need(self.max_lora_rank in (1, 2, 4, 8, 16, 32, 64, 128, 256), f"max_lora_rank must be a power of two in 1..256, got {self.max_lora_rank}")
        need(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        need(self.audit_prompts in ("text", "hash", "none"), f"audit_prompts must be 'text', 'hash' or 'none', got {self.audit_prompts!r}")
        need(self.audit_on_failure in ("reject", "block"), f"audit_on_failure must be 'reject' or 'block', got {self.audit_on_failure!r}")
        need(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        need(_positive(self.audit_timeout), f"audit_timeout must be a number of seconds > 0, got {self.audit_timeout!r}")
        need(_positive(self.shutdown_timeout), f"shutdown_timeout must be a number of seconds > 0, got {self.shutdown_timeout!r}")
        need(self.max_n is None or (isinstance(self.max_n, int) and self.max_n >= 1), f"max_n must be an integer >= 1 or None, got {self.max_n!r}")
        need(self.max_logprobs >= 0, f"max_logprobs must be >= 0, got {self.max_logprobs}")

    def resolved_max_n(self, num_kv_blocks: int) -> int:
        """max_n, or its default for a KV cache of `num_kv_blocks` blocks (see the class docstring)."""
        if self.max_n is not None:
            return self.max_n
        return max(1, min(128, self.max_num_seqs, num_kv_blocks))

    @property
    def tokenizer_path(self) -> str:
        return str(self.tokenizer or self.model)

    @property
    def cpu_lora_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
