"""LoraCheckpoint: one PEFT adapter read from disk, validated against the base model, fingerprinted.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (the
``adapter_model.bin`` pickle format is refused). Nothing is read whole before it is checked:
the config's size is checked before it is read, then the safetensors header (a length and a
JSON object at the start of the file) is read and every tensor's name, dtype, shape and byte
range is checked against the base model and ``max_lora_rank``, and the file's size against the
header (its data section must be exactly the tensors' bytes, as the format requires), before a
single tensor byte is read. Only then are the tensors read, each ONCE, into memory; the
fingerprint and the weights both come from that one snapshot, so the weights an engine applies
are exactly the bytes the fingerprint names, even if the folder changes meanwhile. A file of
any size with a header that does not fit the base model is refused after reading its header.

Fingerprint (version 1) -- what an auditor recomputes to check an adapter on disk
---------------------------------------------------------------------------------
``frame(b)`` is ``len(b)`` as 8 bytes big-endian followed by the bytes ``b``. The fingerprint
is the lowercase hex SHA-256 of the concatenation of these frames, in this order:

1. ``frame(b"loraledger-adapter-fingerprint/v1")`` -- the algorithm's name and version.
2. ``frame(C)`` where ``C`` is the whole of ``adapter_config.json`` parsed as JSON and
   re-serialized with Python's
   ``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``,
   encoded as UTF-8 (so whitespace and key order in the file do not matter, values do).
3. For every tensor of ``adapter_model.safetensors`` (the ``__metadata__`` entry is not a
   tensor and is left out), in ascending order of the tensor name's code points, four frames:
   ``frame(name as UTF-8)``, ``frame(dtype string as in the safetensors header, ASCII,
   e.g. b"BF16")``, ``frame(shape as JSON without spaces, ASCII, e.g. b"[8,4096]"; b"[]"
   for a scalar)``, ``frame(the tensor's raw bytes exactly as stored in the file, i.e. the
   data section slice [begin, end) of its data_offsets)``.

Every field is length-prefixed and every tensor contributes exactly four frames, so the
byte stream parses back to one input only: two different adapters cannot collide by
concatenation. Any changed byte of a config value or of a tensor changes the fingerprint;
the safetensors header layout (its order, padding, metadata) does not. The same function
runs in ``load_lora_checkpoint`` and in ``fingerprint_adapter``, the cheap re-check that
crash recovery uses.

Validation (``load_lora_checkpoint`` only) raises the typed errors of
``loraledger.errors``; every message says what was wrong and what to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from loraledger.digests import adapter_fingerprint
from loraledger.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterRankError,
    AdapterShapeError,
    AdapterTargetError,
    AdapterUnsupportedError,
)
from loraledger.gpu.config import LORA_TARGETS, ModelConfig
from loraledger.gpu.lora_slots import SlotStacks, stack_for_slots
from loraledger.store.records import AdapterRecord

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# safetensors dtype string -> (torch dtype, bytes per element); others are refused on load
_DTYPES = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
}
_MAX_HEADER_BYTES = 16 << 20  # ~100,000 tensors' entries: far above any LoRA (the safetensors library allows 100 MB)
_MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes
_BLOCK_OF = {m: ("mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn") for m in LORA_TARGETS}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight
_TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<module>\w+)"
    r"\.(?P<ab>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight"
)


@dataclass(frozen=True, eq=False)  # eq=False: identity hash, so it can key dicts despite the dict/tensor fields
class LoraCheckpoint:
    """An adapter in host memory: immutable once built, shared by the loader's LRU and the device slots.

    ``weights[(layer, module)] = (A [r, in_features], B [out_features, r])``, fp32, CPU and
    unscaled: the delta is ``scale * (x @ A.T) @ B.T``. A (layer, module) pair that is absent
    contributes nothing. When the checkpoint carries ``slot_stacks`` (every checkpoint
    load_lora_checkpoint returns does) the weights are views into them, so a cached adapter holds
    its tensors once; B is then contiguous only when r equals the stacks' max_lora_rank.
    """

    name: str
    int_id: int
    path: str
    fingerprint: str
    rank: int
    alpha: float
    use_rslora: bool
    scale: float  # alpha / r, or alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]  # the modules that carry tensors, in LORA_TARGETS order
    config: dict  # adapter_config.json as read
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    nbytes: int  # host memory the checkpoint's tensors hold
    # the weights laid out as a device slot holds them, built while loading so a slot load is a copy
    slot_stacks: SlotStacks | None = None
    # PEFT's rank_pattern / alpha_pattern: each (layer, module)'s own scale where it differs from `scale`
    module_scales: Mapping[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    max_rank: int = 0  # the largest rank of any module (rank_pattern may exceed r); 0: `rank`

    @property
    def slot_rank(self) -> int:
        """The rank a device slot must keep for this adapter: rows past it are zero padding."""
        return self.max_rank or self.rank

    def to_record(self, base_model_fingerprint: str, first_seen: float) -> AdapterRecord:
        return AdapterRecord(
            fingerprint=self.fingerprint,
            name=self.name,
            int_id=self.int_id,
            path=self.path,
            rank=self.rank,
            alpha=self.alpha,
            target_modules=list(self.target_modules),
            base_model_fingerprint=base_model_fingerprint,
            use_rslora=self.use_rslora,
            first_seen=first_seen,
        )


@dataclass(frozen=True)
class _RawTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte range in the data section (after the header)
    end: int
    data: bytearray | None = None  # the bytes as stored, once read (_read_tensors)


class _Errors:
    """Builds typed errors that all carry the adapter's name and path."""

    def __init__(self, lora_name: str | None, lora_path: str):
        self.lora_name, self.lora_path = lora_name, lora_path

    def __call__(self, cls: type[Exception], message: str) -> Exception:
        return cls(message, lora_name=self.lora_name, lora_path=self.lora_path)


def fingerprint_adapter(path: str) -> str:
    """The adapter folder's fingerprint (see the module docstring); no validation beyond readability."""
    err = _Errors(None, path)
    config_path, weights_path = _adapter_files(Path(path), err)
    config = _parse_config(_read_config(config_path, err), err)
    with _open_weights(weights_path, err) as f:
        raw = _read_tensors(f, _read_header(f, err), err)
    return adapter_fingerprint(config, raw)


def load_lora_checkpoint(
    path: str, *, lora_name: str, lora_int_id: int, model_config: ModelConfig, max_lora_rank: int
) -> LoraCheckpoint:
    """Read, validate and fingerprint one PEFT LoRA adapter folder. Touches no global state (thread-safe).

    Everything is checked before the tensors are read (see the module docstring): the memory a load
    takes is bounded by what the base model and max_lora_rank allow, whatever the file's size.
    """
    err = _Errors(lora_name, path)
    config_path, weights_path = _adapter_files(Path(path), err)
    config = _parse_config(_read_config(config_path, err), err)
    _check_supported(config, err)
    rank, alpha, use_rslora = _rank_and_alpha(config, err)
    patterns = _patterns(config, err)
    if rank > max_lora_rank and not patterns.ranks:
        raise _rank_error(err, f"adapter rank r={rank}", rank, max_lora_rank)
    declared = _declared_targets(config, model_config, err)
    with _open_weights(weights_path, err) as f:
        entries = _read_header(f, err)
        _check_tensors(_group_tensors(entries, err), patterns.rank_of(rank), declared, model_config, max_lora_rank, err)
        raw = _read_tensors(f, entries, err)
    fingerprint = adapter_fingerprint(config, raw)
    pairs = _group_tensors(raw, err)
    weights = _build_weights(pairs, err)

    def scale_of(r: int, a: float) -> float:
        return a / math.sqrt(r) if use_rslora else a / r

    scale = scale_of(rank, alpha)
    module_scales = {}
    for key, (a_w, _) in weights.items():
        own = scale_of(a_w.shape[0], patterns.alpha_of(alpha)(key))
        if own != scale:
            module_scales[key] = own
    present = {module for _, module in weights}
    ckpt = LoraCheckpoint(
        name=lora_name,
        int_id=lora_int_id,
        path=path,
        fingerprint=fingerprint,
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        scale=scale,
        target_modules=tuple(m for m in LORA_TARGETS if m in present),
        config=config,
        weights=types.MappingProxyType(weights),
        nbytes=sum(a.nbytes + b.nbytes for a, b in weights.values()),
        module_scales=types.MappingProxyType(module_scales),
        max_rank=max(a_w.shape[0] for a_w, _ in weights.values()),
    )
    stacks = stack_for_slots(model_config, max_lora_rank, ckpt)
    _check_finite(pairs, weights, stacks, err)
    # the stacks hold every value of the weights: keep those, and the weights as views into them
    views = types.MappingProxyType({key: stacks.module_views[key] for key in weights})  # in the weights' order
    return dataclasses.replace(ckpt, weights=views, slot_stacks=stacks, nbytes=stacks.nbytes())


# ---- reading and fingerprinting -------------------------------------------------------------


def _adapter_files(folder: Path, err: _Errors) -> tuple[Path, Path]:
    """The config and weights files of an adapter folder, or AdapterNotFoundError saying which is missing."""
    try:
        exists, is_dir = folder.exists(), folder.is_dir()
    except (OSError, ValueError) as exc:  # ValueError: a path with NUL
        raise err(
            AdapterNotFoundError,
            f"adapter folder {str(folder)!r} cannot be opened ({exc}); check the LoRARequest's lora_path",
        ) from exc
    if not exists:
        raise err(
            AdapterNotFoundError, f"adapter folder {str(folder)!r} does not exist; check the LoRARequest's lora_path"
        )
    if not is_dir:
        raise err(
            AdapterNotFoundError,
            f"{str(folder)!r} is not a directory; lora_path must name the "
            f"folder holding {CONFIG_FILE} and {WEIGHTS_FILE}",
        )
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise err(
            AdapterNotFoundError,
            f"{CONFIG_FILE} is missing from {str(folder)!r}; save the adapter with peft's save_pretrained()",
        )
    if not weights_path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise err(
                AdapterNotFoundError,
                f"only {WEIGHTS_FILE} is supported and the folder holds adapter_model.bin; "
                'convert it: python -c "import torch; from safetensors.torch import save_file; '
                "save_file(torch.load('adapter_model.bin'), 'adapter_model.safetensors')\"",
            )
        raise err(
            AdapterNotFoundError,
            f"{WEIGHTS_FILE} is missing from {str(folder)!r}; save the adapter with peft's save_pretrained()",
        )
    return config_path, weights_path


def _read_config(path: Path, err: _Errors) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise err(AdapterNotFoundError, f"cannot read {CONFIG_FILE}: {exc}; check the folder's permissions") from exc
    if len(data) > _MAX_CONFIG_BYTES:
        raise err(
            AdapterFormatError,
            f"{CONFIG_FILE} is larger than {_MAX_CONFIG_BYTES} bytes; it is not a PEFT adapter config, re-save the adapter",
        )
    return data


@contextlib.contextmanager
def _open_weights(path: Path, err: _Errors):
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise err(AdapterNotFoundError, f"cannot read {WEIGHTS_FILE}: {exc}; check the folder's permissions") from exc
    with f:
        yield f


def _corrupt(err: _Errors, why: str) -> Exception:
    return err(
        AdapterFormatError, f"{WEIGHTS_FILE} is corrupt or truncated ({why}); re-save or re-download the adapter"
    )


def _read_header(f, err: _Errors) -> list[_RawTensor]:
    """The tensors the safetensors header declares, sorted by name, without their bytes.

    Reads the 8-byte header length and the header only. Refuses a header longer than the file or than
    _MAX_HEADER_BYTES, a malformed entry, and a data section that is not exactly its tensors' bytes
    (the format allows no holes and nothing after the last tensor), so the file's size is checked
    against the header here, before any tensor byte is read.
    """
    try:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
    except OSError as exc:
        raise err(AdapterNotFoundError, f"cannot read {WEIGHTS_FILE}: {exc}; check the folder's permissions") from exc
    if len(head) < 8:
        raise _corrupt(err, f"{size} bytes, shorter than the 8-byte header length")
    header_len = int.from_bytes(head, "little")
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
        raise _corrupt(err, f"header length {header_len} does not fit the {size}-byte file")
    try:
        header = json.loads(f.read(header_len).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _corrupt(err, f"header is not JSON: {exc}") from exc
    except OSError as exc:
        raise err(AdapterNotFoundError, f"cannot read {WEIGHTS_FILE}: {exc}; check the folder's permissions") from exc
    if not isinstance(header, dict):
        raise _corrupt(err, "header is not a JSON object")
    data_len = size - 8 - header_len
    tensors = []
    for name in sorted(header):
        if name == "__metadata__":
            continue
        entry = header[name]
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = (
                isinstance(dtype, str)
                and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
                and type(begin) is int
                and type(end) is int
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise _corrupt(err, f"malformed header entry for {name!r}")
        if not 0 <= begin <= end <= data_len:
            raise _corrupt(err, f"tensor {name!r} spans bytes {begin}..{end} of a {data_len}-byte data section")
        tensors.append(_RawTensor(name, dtype, tuple(shape), begin, end))
    covered = 0
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if t.begin != covered:
            raise _corrupt(
                err,
                f"the data section has bytes {covered}..{t.begin} that belong to no tensor (or tensors that overlap)",
            )
        covered = t.end
    if covered != data_len:
        raise _corrupt(
            err,
            f"the data section has {data_len - covered} bytes after the last tensor (the file is {size} bytes, its tensors end at byte {8 + header_len + covered})",
        )
    return tensors


def _read_tensors(f, tensors: list[_RawTensor], err: _Errors) -> list[_RawTensor]:
    """`tensors` with their bytes, each read once from the open file (the header's size checks came first)."""
    data_start = f.tell()
    out = []
    for t in tensors:
        buf = bytearray(t.end - t.begin)
        try:
            f.seek(data_start + t.begin)
            got = f.readinto(buf)
        except OSError as exc:
            raise err(
                AdapterNotFoundError, f"cannot read {WEIGHTS_FILE}: {exc}; check the folder's permissions"
            ) from exc
        if got != len(buf):
            raise _corrupt(err, f"tensor {t.name!r}: the file ended after {got} of its {len(buf)} bytes")
        out.append(dataclasses.replace(t, data=buf))
    return out


def _parse_config(data: bytes, err: _Errors) -> dict:
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise err(AdapterFormatError, f"{CONFIG_FILE} is not valid JSON ({exc}); re-save the adapter") from exc
    if not isinstance(config, dict):
        raise err(
            AdapterFormatError,
            f"{CONFIG_FILE} must hold a JSON object, got {type(config).__name__}; re-save the adapter",
        )
    return config


# ---- validation -----------------------------------------------------------------------------


def _check_supported(config: dict, err: _Errors) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise err(
            AdapterUnsupportedError,
            f"peft_type {peft_type!r} is not supported yet; only LoRA adapters (peft_type 'LORA') can be served",
        )
    problems = []
    if config.get("use_dora"):
        problems.append("use_dora=true (DoRA)")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save={config['modules_to_save']!r} (fully trained extra modules)")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config['bias']!r} (trained biases)")
    if config.get("lora_bias"):
        problems.append("lora_bias=true (a bias on lora_B)")
    for key in (
        "fan_in_fan_out",
        "layer_replication",
        "target_parameters",
        "trainable_token_indices",
        "alora_invocation_tokens",
    ):
        if config.get(key):
            problems.append(f"{key}={config[key]!r}")
    if problems:
        raise err(
            AdapterUnsupportedError,
            f"the adapter uses {', '.join(problems)}, which is not supported yet; "
            "retrain or re-export it as a plain LoRA adapter without these options",
        )


def _rank_and_alpha(config: dict, err: _Errors) -> tuple[int, float, bool]:
    # missing values take PEFT's LoraConfig defaults, as PEFT itself would when loading
    rank, alpha, rslora = config.get("r", 8), config.get("lora_alpha", 8), config.get("use_rslora", False)
    if type(rank) is not int or rank < 1:
        raise err(AdapterFormatError, f"{CONFIG_FILE} has r={rank!r}; it must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise err(AdapterFormatError, f"{CONFIG_FILE} has lora_alpha={alpha!r}; it must be a finite number")
    if not isinstance(rslora, bool):
        raise err(AdapterFormatError, f"{CONFIG_FILE} has use_rslora={rslora!r}; it must be true or false")
    return rank, float(alpha), rslora


def _rank_error(err: _Errors, what: str, rank: int, max_lora_rank: int) -> Exception:
    allowed = 1 << (rank - 1).bit_length()  # EngineArgs accepts powers of two only
    return err(
        AdapterRankError,
        f"{what}, above max_lora_rank={max_lora_rank}; raise max_lora_rank to at least {rank} "
        f"(max_lora_rank={allowed}, it must be a power of two)",
    )


def _candidate_modules(model_config: ModelConfig) -> list[str]:
    """Names (as PEFT matches them) of the base model's modules a LoRA could target."""
    names = ["model.embed_tokens", "lm_head"]
    for layer in range(model_config.num_hidden_layers):
        names += [f"model.layers.{layer}.{_BLOCK_OF[m]}.{m}" for m in LORA_TARGETS]
    return names


def _matches(pattern: object, key: str) -> bool:
    """PEFT's rule: a string is a regex that must match the whole name; a list entry matches by dotted suffix."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, key) is not None
    return any(key == t or key.endswith("." + t) for t in pattern)


def _in_transformed_layers(config: dict, key: str, err: _Errors) -> bool:
    """PEFT's layers_to_transform / layers_pattern rule for one module name (a list of target names only):
    the module's layer index, found after a layers_pattern segment (any segment when there is none),
    must be the given index or one of the given list."""
    indexes, pattern = config.get("layers_to_transform"), config.get("layers_pattern")
    if indexes is None or indexes == []:
        return True
    ok_indexes = (type(indexes) is int and indexes >= 0) or (
        isinstance(indexes, list) and all(type(i) is int and i >= 0 for i in indexes)
    )
    ok_pattern = (
        pattern is None
        or isinstance(pattern, str)
        or (isinstance(pattern, list) and all(isinstance(p, str) for p in pattern))
    )
    if not (ok_indexes and ok_pattern):
        raise err(
            AdapterFormatError,
            f"{CONFIG_FILE} has layers_to_transform={indexes!r} / layers_pattern={pattern!r}; "
            "they must be a layer index or a list of them / a name or a list of names",
        )
    if not pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        match = None
        for p in [pattern] if isinstance(pattern, str) else pattern:
            try:
                match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            except re.error as exc:
                raise err(
                    AdapterFormatError, f"{CONFIG_FILE} layers_pattern {p!r} is not a valid regex: {exc}"
                ) from exc
            if match is not None:
                break
    if match is None:
        return False
    layer = int(match["idx"])
    return layer == indexes if type(indexes) is int else layer in indexes


@dataclass(frozen=True)
class _Patterns:
    """PEFT's rank_pattern and alpha_pattern: per-module r and lora_alpha, matched by peft's rule (the first key,
    in the config's order, that matches the end of the module's name after a dot, as a regex)."""

    ranks: dict
    alphas: dict

    @staticmethod
    def _key(pattern: dict, name: str) -> str | None:
        return next((k for k in pattern if re.match(rf"(.*\.)?({k})$", name)), None)

    def rank_of(self, default: int):
        def rank(key: tuple[int, str]) -> int:
            found = self._key(self.ranks, _module_name(key))
            return default if found is None else self.ranks[found]

        return rank

    def alpha_of(self, default: float):
        def alpha(key: tuple[int, str]) -> float:
            found = self._key(self.alphas, _module_name(key))
            return default if found is None else float(self.alphas[found])

        return alpha


def _module_name(key: tuple[int, str]) -> str:
    layer, module = key
    return f"model.layers.{layer}.{_BLOCK_OF[module]}.{module}"


def _patterns(config: dict, err: _Errors) -> _Patterns:
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not isinstance(ranks, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 1 for k, v in ranks.items()
    ):
        raise err(
            AdapterFormatError,
            f"{CONFIG_FILE} rank_pattern must map module names to positive integer ranks, got {ranks!r}",
        )
    if not isinstance(alphas, dict) or not all(
        isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        for k, v in alphas.items()
    ):
        raise err(
            AdapterFormatError, f"{CONFIG_FILE} alpha_pattern must map module names to finite numbers, got {alphas!r}"
        )
    for k in (*ranks, *alphas):
        try:
            re.compile(k)
        except re.error as exc:
            raise err(
                AdapterFormatError, f"{CONFIG_FILE} rank_pattern/alpha_pattern key {k!r} is not a valid regex: {exc}"
            ) from exc
    return _Patterns(ranks, alphas)


def _declared_targets(config: dict, model_config: ModelConfig, err: _Errors) -> set[str] | None:
    """The full module names adapter_config.json targets (None: not declared), refusing unsupported ones."""
    targets, exclude = config.get("target_modules"), config.get("exclude_modules")
    if targets is None:
        return None
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(LORA_TARGETS)  # PEFT's shorthand: every linear layer except the output layer
    valid = isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))
    valid_ex = (
        exclude is None
        or isinstance(exclude, str)
        or (isinstance(exclude, list) and all(isinstance(t, str) for t in exclude))
    )
    if not (valid and valid_ex):
        raise err(
            AdapterFormatError,
            f"{CONFIG_FILE} target_modules/exclude_modules must be a list of names or a regex string",
        )
    try:
        declared = {
            k
            for k in _candidate_modules(model_config)
            if _matches(targets, k) and not (exclude and _matches(exclude, k))
        }
    except re.error as exc:
        raise err(
            AdapterFormatError, f"{CONFIG_FILE} target_modules/exclude_modules is not a valid regex: {exc}"
        ) from exc
    if not isinstance(targets, str):  # PEFT applies layers_to_transform to a list of targets only
        declared = {k for k in declared if _in_transformed_layers(config, k, err)}
    bad = sorted({k.rsplit(".", 1)[-1] for k in declared} - set(LORA_TARGETS))
    if bad:
        raise err(
            AdapterTargetError,
            f"target_modules {targets!r} selects {', '.join(bad)}, which LoRA cannot be applied to here; "
            f"supported targets: {', '.join(LORA_TARGETS)}. Retrain without them",
        )
    if not declared:
        raise err(
            AdapterTargetError,
            f"target_modules {targets!r} matches no module of this {model_config.architecture} base model; "
            f"supported targets: {', '.join(LORA_TARGETS)}. Is the adapter for another base model?",
        )
    return declared


def _group_tensors(raw: list[_RawTensor], err: _Errors) -> dict[tuple[int, str], dict[str, _RawTensor]]:
    """(layer, module) -> {"lora_A": tensor, "lora_B": tensor} from the PEFT tensor names."""
    if not raw:
        raise err(AdapterFormatError, f"{WEIGHTS_FILE} holds no tensors; re-save the adapter")
    unsupported, full_weights = set(), []
    for t in raw:
        parts = t.name.split(".")
        lora_at = next((i for i, p in enumerate(parts) if p.startswith("lora_")), None)
        if lora_at is None:
            full_weights.append(t.name)
        elif parts[lora_at] == "lora_magnitude_vector":
            raise err(
                AdapterUnsupportedError,
                f"tensor {t.name!r} is a DoRA magnitude vector; DoRA is not supported yet, use a plain LoRA adapter",
            )
        elif lora_at == 0 or parts[lora_at - 1] not in LORA_TARGETS:
            unsupported.add(".".join(parts[:lora_at]) or t.name)
    if unsupported:
        raise err(
            AdapterTargetError,
            f"the adapter has LoRA tensors for {', '.join(sorted(unsupported))}, which LoRA cannot be "
            f"applied to here; supported targets: {', '.join(LORA_TARGETS)}. Retrain without them",
        )
    if full_weights:
        # PEFT writes whole weights for modules_to_save and for saved embedding layers
        raise err(
            AdapterUnsupportedError,
            f"the adapter holds full (non-LoRA) weights such as {full_weights[0]!r}; replacing base "
            "weights is not supported yet, export a plain LoRA adapter (no modules_to_save, "
            "save_embedding_layers=False)",
        )

    pairs: dict[tuple[int, str], dict[str, _RawTensor]] = {}
    adapter_names = set()
    for t in raw:
        m = _TENSOR_NAME.fullmatch(t.name)
        if m is None:
            cls = AdapterUnsupportedError if t.name.endswith(".bias") else AdapterFormatError
            raise err(
                cls,
                f"tensor name {t.name!r} is not a supported PEFT LoRA weight "
                "(expected base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_A|lora_B.weight)",
            )
        module = m["module"]
        if m["block"] != _BLOCK_OF[module]:
            raise err(
                AdapterFormatError, f"tensor {t.name!r}: {module} belongs under {_BLOCK_OF[module]}, not {m['block']}"
            )
        adapter_names.add(m["adapter"])
        slot = pairs.setdefault((int(m["layer"]), module), {})
        if m["ab"] in slot:
            raise err(
                AdapterFormatError,
                f"{WEIGHTS_FILE} holds two {m['ab']} tensors for layer {m['layer']} {module}; "
                "save a single adapter per folder",
            )
        slot[m["ab"]] = t
    if len(adapter_names) > 1:
        raise err(
            AdapterFormatError,
            f"{WEIGHTS_FILE} mixes adapter names {sorted(map(str, adapter_names))}; save one adapter per folder",
        )
    return pairs


def _some(names: list[str], shown: int = 3) -> str:
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _to_fp32(t: _RawTensor, err: _Errors) -> torch.Tensor:
    _check_dtype_and_size(t, len(t.data), err)
    dtype = _DTYPES[t.dtype][0]
    if not t.data:
        return torch.zeros(t.shape, dtype=torch.float32)
    # the buffer is our own (aligned, writable) bytearray, so frombuffer is safe; .to() makes the fp32 tensor own its memory
    flat = torch.frombuffer(t.data, dtype=dtype)
    return flat.to(torch.float32, copy=True).reshape(t.shape).contiguous()


def _check_finite(
    pairs: dict[tuple[int, str], dict[str, _RawTensor]],
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    stacks: SlotStacks,
    err: _Errors,
) -> None:
    """Refuse NaN or infinite weights: they would write garbage for every request on the adapter.

    Checked on the few slot-ready stacks (one op each, instead of two per tensor: a load is on the
    critical path of adapter churn), and B's largest magnitude times the scale in fp32 (what a slot
    will hold); only when one fails are the tensors searched for the culprit.
    """
    finite = all(bool(torch.isfinite(t).all()) for pair in stacks.groups.values() for t in pair)
    if finite and all(
        bool(torch.isfinite(b.abs().amax() * stacks.largest_scale(group))) for group, (_, b) in stacks.groups.items()
    ):
        return
    for key, (a, b) in weights.items():
        for raw, tensor in ((pairs[key]["lora_A"], a), (pairs[key]["lora_B"], b)):
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise err(
                    AdapterFormatError,
                    f"tensor {raw.name!r} holds {bad} NaN or infinite value(s) (as fp32); the adapter "
                    "is broken (diverged training or a bad conversion), re-train or re-export it",
                )
    raise err(
        AdapterFormatError,
        "lora_B times the adapter's scale (lora_alpha / r) overflows fp32; "
        "the adapter is broken, re-train or re-export it",
    )


def _check_tensors(
    pairs: dict[tuple[int, str], dict[str, _RawTensor]],
    rank_of,  # (layer, module) -> the rank adapter_config.json gives it (r, or its rank_pattern entry)
    declared: set[str] | None,
    model_config: ModelConfig,
    max_lora_rank: int,
    err: _Errors,
) -> None:
    """Every tensor's dtype, shape and byte length against the base model, the config and max_lora_rank.

    Works on the header's entries alone: passing it bounds the bytes the tensors hold by what the
    base model allows, before they are read."""
    shapes = model_config.module_shapes()
    n_layers = model_config.num_hidden_layers

    def bad(message: str) -> Exception:
        return err(AdapterShapeError, message + "; the adapter was probably trained for a different base model")

    for (layer, module), slot in pairs.items():
        if layer >= n_layers:
            raise bad(f"the adapter has tensors for layer {layer}, the base model has {n_layers} layers")
        for ab in ("lora_A", "lora_B"):
            if ab not in slot:
                raise err(
                    AdapterShapeError,
                    f"layer {layer} {module} has no {ab} tensor (a LoRA needs both A and B); "
                    "the file is incomplete, re-save the adapter",
                )
            if len(slot[ab].shape) != 2:
                raise bad(f"{slot[ab].name} has shape {list(slot[ab].shape)}, a LoRA weight is 2-D")
        a_rank, b_rank = slot["lora_A"].shape[0], slot["lora_B"].shape[1]
        if max(a_rank, b_rank) > max_lora_rank:
            raise _rank_error(
                err, f"layer {layer} {module} has rank {max(a_rank, b_rank)}", max(a_rank, b_rank), max_lora_rank
            )
        if a_rank != b_rank:
            raise bad(f"layer {layer} {module}: lora_A has rank {a_rank} but lora_B has rank {b_rank}")
        rank = rank_of((layer, module))
        if a_rank != rank:
            raise bad(
                f"layer {layer} {module} has rank {a_rank} but adapter_config.json gives it r={rank} (r or rank_pattern)"
            )
        in_f, out_f = shapes[module]
        got_a, got_b = slot["lora_A"].shape, slot["lora_B"].shape
        if got_a[1] != in_f or got_b[0] != out_f:
            raise bad(
                f"layer {layer} {module}: lora_A is {list(got_a)} and lora_B is {list(got_b)}, "
                f"the base model needs [{rank}, {in_f}] and [{out_f}, {rank}]"
            )

    if declared is not None:
        have = {f"model.layers.{layer}.{_BLOCK_OF[m]}.{m}" for layer, m in pairs}
        if extra := sorted(have - declared):
            raise err(
                AdapterFormatError,
                f"the weights file has tensors for {_some(extra)}, which adapter_config.json "
                "target_modules does not declare; the files disagree, re-save the adapter",
            )
        if missing := sorted(declared - have):
            raise err(
                AdapterShapeError,
                f"adapter_config.json targets {_some(missing)} but the weights file has no "
                "tensors for them; the file is incomplete, re-save the adapter",
            )
    for slot in pairs.values():
        for t in slot.values():
            _check_dtype_and_size(t, t.end - t.begin, err)


def _check_dtype_and_size(t: _RawTensor, nbytes: int, err: _Errors) -> None:
    if t.dtype not in _DTYPES:
        raise err(
            AdapterFormatError, f"tensor {t.name!r} has dtype {t.dtype}; only F32, F16, BF16 and F64 are supported"
        )
    numel = math.prod(t.shape)
    if numel * _DTYPES[t.dtype][1] != nbytes:
        raise err(
            AdapterFormatError,
            f"tensor {t.name!r}: shape {list(t.shape)} of {t.dtype} needs {numel * _DTYPES[t.dtype][1]} bytes, "
            f"the file holds {nbytes}; the file is corrupt, re-save the adapter",
        )


def _build_weights(
    pairs: dict[tuple[int, str], dict[str, _RawTensor]], err: _Errors
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) fp32 tensors per (layer, module), in layer then LORA_TARGETS order (checked by _check_tensors)."""
    order = {m: i for i, m in enumerate(LORA_TARGETS)}
    return {
        key: (_to_fp32(pairs[key]["lora_A"], err), _to_fp32(pairs[key]["lora_B"], err))
        for key in sorted(pairs, key=lambda k: (k[0], order[k[1]]))
    }
