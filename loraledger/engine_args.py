"""EngineArgs: every knob of the engine in one frozen, validated struct."""

from __future__ import annotations

import difflib
import math
import os

import msgspec

from loraledger.errors import ConfigError, QuantizationError
from loraledger.quantization.detection import METHODS as QUANT_METHODS
from loraledger.quantization.detection import SUPPORTED as QUANT_SUPPORTED

DEFAULT_AUDIT_URL = "default"  # resolved by loraledger.paths.default_audit_url(): a SQLite file in the data dir ($LORALEDGER_HOME or the user's)

# vLLM's dtype names -> ours ("half" and "float" are vLLM's aliases of float16 and float32)
DTYPE_ALIASES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "float": "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
}
SCALE_OUT = (
    "one engine runs on one device; to serve on several GPUs or machines, run several replicas (each with "
    "tensor_parallel_size=1 and pipeline_parallel_size=1) behind Ray Serve, loraledger's scale-out path, "
    "all writing one PostgreSQL audit log"
)


def check_argument_names(names, known, owner: str) -> None:
    """ConfigError for the first name not in `known`, naming the closest known argument (as difflib sees it)."""
    for name in names:
        if name in known:
            continue
        close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else "; see loraledger.EngineArgs for the accepted names"
        raise ConfigError(f"unknown {owner} argument {name!r}{hint}")


class _ArgsMeta(type(msgspec.Struct)):
    """Builds EngineArgs with every keyword name checked first: an unknown one is a ConfigError naming the closest known one."""

    def __call__(cls, *args, **kwargs):
        check_argument_names(kwargs, cls.__struct_fields__, cls.__name__)
        return super().__call__(*args, **kwargs)


class EngineArgs(msgspec.Struct, frozen=True, kw_only=True, metaclass=_ArgsMeta):
    """Every knob of the engine (fields below, each with a comment); checked when built (ConfigError).

    max_n bounds SamplingParams.n, the completions one request may ask for; admission refuses a
    request above it with SamplingParamsError. Its default (None) is resolved when the engine starts
    to the smallest of 128, max_num_seqs and the number of KV-cache blocks. Each of a request's
    sequences takes a seat in the running batch and needs at least one KV block of its own for what
    it generates, so a request at the limit can still run all its sequences in one step; the KV
    cache is what ties the bound to the model: a larger model (more layers, more KV heads) fits
    fewer blocks in the same kv_cache_bytes, so its default is lower. 128 (the OpenAI API's bound on
    n) caps the work and output of one request at a few hundred completions whatever the cache.
    Seats are shared between requests (loraledger/scheduling/fair_seats.py), so a request with many sequences does
    not hold back those that arrive after it. max_logprobs bounds SamplingParams.logprobs and
    prompt_logprobs (20, vLLM's default; -1: the whole vocabulary).

    vLLM's arguments that have no counterpart here are accepted with the meaning given beside each:
    some act (tokenizer_mode, generation_config, skip_tokenizer_init, enable_chunked_prefill,
    gpu_memory_utilization on CUDA, max_seq_len_to_capture), some are checked for the one value that
    works here (tensor_parallel_size, pipeline_parallel_size), revision, tokenizer_revision and
    download_dir act as in vLLM for Hub repo ids (loraledger/sources), and the
    rest change nothing (swap_space, disable_log_stats, trust_remote_code): the README's table
    "Differences from vLLM" lists them.
    """

    model: str  # a checkpoint folder, or a Hugging Face Hub repo id (`org/name`; a folder that exists wins)
    tokenizer: str | None = None  # a folder or a Hub repo id; default: the model's
    dtype: str = "auto"  # "auto" | "float32" ("float") | "bfloat16" | "float16" ("half"), or a torch dtype
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    seed: int | None = 0  # None: a random seed for the engine's unseeded requests
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
    # seconds an engine's lease in its audit database lasts without a renewal (renewed every third of it). Engines
    # sharing one database record a peer's unfinished requests as interrupted only once its lease has expired, so a
    # crashed peer is recovered within about this long; must exceed audit_timeout (one renewal's deadline)
    audit_lease_seconds: float = 30.0
    # the Ed25519 PEM key that signs each finished request's receipt and the log's checkpoints (EVIDENCE.md); None:
    # $LORALEDGER_LOG_KEY, else a key kept in the data folder (made on first use)
    log_key_file: str | None = None
    num_threads: int | None = None  # torch intra-op threads on the CPU path; default: torch's choice
    enforce_eager: bool = False  # CUDA: never replay CUDA graphs for decode steps (every kernel launched from Python)
    # plan and launch step N+1 while step N runs, its sampled ids fed to N+1 on the device; None: on CUDA, where
    # the device then never waits for the engine's Python; off on the CPU, where a step's launch is its whole
    # computation and the overlap only adds a thread competing for the cores (0.90x-1.03x: bench.overlap)
    async_scheduling: bool | None = None
    max_n: int | None = None  # most completions per request (SamplingParams.n); None: see the class docstring
    max_logprobs: int = 20  # most top alternatives SamplingParams.logprobs / prompt_logprobs may ask for (vLLM's default); -1: the vocabulary
    # --- vLLM's arguments (see the class docstring) ---
    trust_remote_code: bool = (
        False  # accepted; code shipped with a checkpoint never runs: a checkpoint that needs it is refused
    )
    tensor_parallel_size: int = 1  # only 1: more devices is the scale-out path (several replicas behind Ray Serve)
    pipeline_parallel_size: int = 1  # only 1, as tensor_parallel_size
    disable_log_stats: bool = False  # accepted; the engine logs no periodic statistics (get_stats() asks for them)
    tokenizer_mode: str = "auto"  # "auto": the fast tokenizer where there is one; "slow": the Python one
    # the base model's weight quantization (vLLM's quantization=): None reads it from the checkpoint (config.json's
    # quantization_config, or a .gguf model); a method name ("gptq", "awq", "compressed-tensors", "bitsandbytes",
    # "gguf") must match what the checkpoint holds (QuantizationError otherwise); any other method is refused
    quantization: str | None = None
    revision: str | None = None  # a Hub model's branch, tag or commit sha (None: "main"); the commit read is on record
    tokenizer_revision: str | None = (
        None  # the same for a Hub tokenizer (None: revision when the tokenizer is the model's)
    )
    download_dir: str | None = None  # the Hub cache folder (default: HF_HUB_CACHE, else $HF_HOME/hub)
    download_timeout: float = 3600.0  # seconds resolving and downloading the model (or tokenizer) may take
    max_download_bytes: int = 1 << 40  # bytes one model (or tokenizer) download may take; the listing is checked first
    lora_download_timeout: float = 300.0  # seconds resolving and downloading one Hub adapter may take
    max_lora_download_bytes: int = 4 << 30  # bytes one Hub adapter download may take
    # "auto": the model folder's generation_config.json gives default sampling parameters and extra EOS ids;
    # "vllm": ignore it; or a folder holding a generation_config.json
    generation_config: str = "auto"
    enable_chunked_prefill: bool | None = (
        None  # None/True: long prompts run in chunks of the token budget; False: a prompt runs whole
    )
    # CUDA: the share of the device's memory the engine may use; the KV cache gets what weights and the activation
    # peak leave of it (gpu/kv_budget.py), unless num_kv_blocks or kv_cache_bytes is given. No effect on the CPU.
    gpu_memory_utilization: float = 0.9
    max_seq_len_to_capture: int = 8192  # CUDA: decode steps with a longer context run eagerly, not from CUDA graphs
    swap_space: float = 4  # GiB; accepted, unused: a preempted sequence is recomputed, never swapped to host memory
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts only, outputs carry token ids and empty text
    # seconds the engine may take to start (model files read, weights loaded, actors ready); then EngineStartError
    start_timeout: float = 600.0

    def __post_init__(self) -> None:
        dtype = self.dtype
        if not isinstance(dtype, str) and type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch":
            msgspec.structs.force_setattr(
                self, "dtype", str(dtype).removeprefix("torch.")
            )  # vLLM also takes torch dtypes
        elif isinstance(dtype, str):
            msgspec.structs.force_setattr(self, "dtype", dtype.lower())
        try:
            self._check()
        except TypeError as exc:  # a comparison with a value of the wrong type
            raise ConfigError(
                f"an EngineArgs value has the wrong type ({exc}); see loraledger.EngineArgs for each field's type"
            ) from exc

    def _check(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ConfigError(message)

        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_loras",
            "max_lora_rank",
            "max_logprobs",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "max_seq_len_to_capture",
        ):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an integer, got {value!r}")
        need(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
            f"seed must be an integer or None, got {self.seed!r}",
        )
        for name in (
            "trust_remote_code",
            "disable_log_stats",
            "skip_tokenizer_init",
            "enable_prefix_caching",
            "enable_lora",
            "audit_durable",
            "resume_interrupted",
            "enforce_eager",
        ):
            need(isinstance(getattr(self, name), bool), f"{name} must be True or False, got {getattr(self, name)!r}")
        need(
            self.enable_chunked_prefill is None or isinstance(self.enable_chunked_prefill, bool),
            "enable_chunked_prefill must be True, False or None",
        )

        need(
            isinstance(self.model, (str, os.PathLike)) and str(self.model) != "",
            "EngineArgs.model must name a model folder",
        )
        need(self.dtype in DTYPE_ALIASES, f"dtype must be one of {', '.join(DTYPE_ALIASES)}, got {self.dtype!r}")
        need(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        need(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        need(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of two in 1..128, got {self.block_size}",
        )
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1")
        need(self.kv_cache_bytes is None or self.kv_cache_bytes >= 1, "kv_cache_bytes must be >= 1")
        need(self.max_loras >= 1, "max_loras must be >= 1")
        need(
            self.max_lora_rank in (1, 2, 4, 8, 16, 32, 64, 128, 256),
            f"max_lora_rank must be a power of two in 1..256, got {self.max_lora_rank}",
        )
        need(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
        )
        need(
            self.audit_prompts in ("text", "hash", "none"),
            f"audit_prompts must be 'text', 'hash' or 'none', got {self.audit_prompts!r}",
        )
        need(
            self.audit_on_failure in ("reject", "block"),
            f"audit_on_failure must be 'reject' or 'block', got {self.audit_on_failure!r}",
        )
        need(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        need(
            _positive(self.audit_timeout), f"audit_timeout must be a number of seconds > 0, got {self.audit_timeout!r}"
        )
        need(
            _positive(self.start_timeout),
            f"start_timeout must be a number of seconds > 0, got {self.start_timeout!r}",
        )
        need(
            _positive(self.shutdown_timeout),
            f"shutdown_timeout must be a number of seconds > 0, got {self.shutdown_timeout!r}",
        )
        need(
            _positive(self.audit_lease_seconds) and self.audit_lease_seconds > self.audit_timeout,
            f"audit_lease_seconds must be a number of seconds greater than audit_timeout ({self.audit_timeout!r}), got "
            f"{self.audit_lease_seconds!r}: a renewal may take audit_timeout, and the lease must outlast it",
        )
        need(
            self.max_n is None or (isinstance(self.max_n, int) and self.max_n >= 1),
            f"max_n must be an integer >= 1 or None, got {self.max_n!r}",
        )
        need(
            self.max_logprobs >= -1,
            f"max_logprobs must be >= 0, or -1 for the whole vocabulary, got {self.max_logprobs}",
        )
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            need(value >= 1, f"{name} must be >= 1, got {value}")
            need(value == 1, f"{name}={value} is not supported: {SCALE_OUT}")
        for name in ("revision", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            need(
                value is None or (isinstance(value, str) and 0 < len(value) <= 4096 and value.isprintable()),
                f"{name} must be None or a non-empty printable string, got {value!r}",
            )
        for name in ("download_timeout", "lora_download_timeout"):
            need(_positive(getattr(self, name)), f"{name} must be a number of seconds > 0, got {getattr(self, name)!r}")
        for name in ("max_download_bytes", "max_lora_download_bytes"):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name} must be an integer number of bytes >= 1, got {value!r}",
            )
        if self.quantization is not None and self.quantization not in QUANT_METHODS:
            raise QuantizationError(
                f"quantization={self.quantization!r} is not supported; supported: {', '.join(QUANT_METHODS)} "
                f"({'; '.join(QUANT_SUPPORTED)})"
            )
        need(
            self.tokenizer_mode in ("auto", "slow"),
            f"tokenizer_mode must be 'auto' or 'slow', got {self.tokenizer_mode!r}",
        )
        need(
            isinstance(self.generation_config, (str, os.PathLike)) and str(self.generation_config) != "",
            f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, got {self.generation_config!r}",
        )
        gmu = self.gpu_memory_utilization
        need(
            isinstance(gmu, (int, float)) and not isinstance(gmu, bool) and 0 < gmu <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {gmu!r}",
        )
        need(
            self.max_seq_len_to_capture >= 1, f"max_seq_len_to_capture must be >= 1, got {self.max_seq_len_to_capture}"
        )
        swap = self.swap_space
        need(
            isinstance(swap, (int, float)) and not isinstance(swap, bool) and swap >= 0,
            f"swap_space must be a number of GiB >= 0, got {swap!r}",
        )

    def resolved_max_n(self, num_kv_blocks: int) -> int:
        """max_n, or its default for a KV cache of `num_kv_blocks` blocks (see the class docstring)."""
        if self.max_n is not None:
            return self.max_n
        return max(1, min(128, self.max_num_seqs, num_kv_blocks))

    @property
    def tokenizer_path(self) -> str:
        return str(self.tokenizer or self.model)

    @property
    def tokenizer_revision_resolved(self) -> str | None:
        """The tokenizer's revision: tokenizer_revision, else the model's revision when the tokenizer is the model's."""
        if self.tokenizer_revision is not None or self.tokenizer not in (None, self.model):
            return self.tokenizer_revision
        return self.revision

    @property
    def torch_dtype_name(self) -> str:
        """dtype with vLLM's aliases resolved: "auto", "float32", "bfloat16" or "float16"."""
        return DTYPE_ALIASES[self.dtype]

    @property
    def chunked_prefill(self) -> bool:
        return self.enable_chunked_prefill is not False

    @property
    def cpu_lora_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


class AsyncEngineArgs(EngineArgs, frozen=True, kw_only=True):
    """vLLM's name for the arguments of an async engine: EngineArgs plus vLLM's request-logging switches."""

    disable_log_requests: bool = True  # accepted; requests are on record in the audit log, not in the log
    enable_log_requests: bool = False  # accepted; see disable_log_requests
