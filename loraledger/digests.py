"""Every digest an auditor recomputes, defined once: the engine writes with these and `audit verify` checks with them.

DIGESTS.md (next to the README) specifies each one byte by byte, with test vectors, for a verifier written
elsewhere. A change here that alters a single output byte breaks every audit log already written: add a new,
versioned digest instead.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import msgspec

GENESIS_HASH = "0" * 64  # prev_hash of event seq 1
ADAPTER_FINGERPRINT_TAG = b"loraledger-adapter-fingerprint/v1"
_FILE_CHUNK = 8 << 20


def bytes_sha256(data: bytes | bytearray | memoryview) -> str:
    """Lowercase hex SHA-256 of data."""
    return hashlib.sha256(data).hexdigest()


def text_sha256(text: str) -> str:
    """SHA-256 of text as UTF-8 (chat templates, constraint text, text prompts)."""
    return bytes_sha256(text.encode("utf-8"))


# -- canonical JSON ----------------------------------------------------------------------------


def _key(key: Any) -> str:
    # the same spelling json.dumps gives non-str keys, so a value and its JSON round trip agree
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    raise TypeError(f"dict key {key!r} ({type(key).__name__}) has no canonical JSON form")


_CONTAINERS = (dict, list, tuple, msgspec.Struct)


def _plain(value: Any) -> Any:
    """value with every dict key a str and every Struct a dict, ready for sort_keys."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value, builtin_types=(dt.datetime,))
    if isinstance(value, dict):
        out = {_key(k): _plain(v) for k, v in value.items()}
        if len(out) != len(value):
            raise ValueError(f"dict keys collide once written as JSON strings: {sorted(map(repr, value))}")
        return out
    if isinstance(value, (list, tuple)):
        if not any(isinstance(v, _CONTAINERS) for v in value):
            return value  # the common flat list (token ids, stop strings): nothing to rewrite
        return [_plain(v) for v in value]
    return value


def _encode_extra(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value, builtin_types=(dt.datetime,))
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r} cannot be encoded canonically: attach a timezone")
        return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    # sets have no canonical order and bytes no JSON form: the caller must choose one
    raise TypeError(f"{type(value).__name__} has no canonical JSON form; convert it to a list, str or dict first")


def canonical_json(obj: Any) -> bytes:
    """UTF-8 JSON with sorted keys and no whitespace.

    Floats are written as their shortest exact repr (1.0 stays 1.0, distinct from 1); aware
    datetimes as ISO-8601 UTC with microseconds (`2026-11-22T12:00:00.000000Z`); msgspec Structs
    as their fields; non-str dict keys as json.dumps spells them (so canonical_json(x) ==
    canonical_json(json_roundtrip(x))). NaN, infinities, naive datetimes, sets and bytes are
    refused with ValueError / TypeError.
    """
    text = json.dumps(
        _plain(obj),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
        default=_encode_extra,
    )
    return text.encode("utf-8")


def digest(obj: Any) -> str:
    """sha256 hex of canonical_json(obj)."""
    return bytes_sha256(canonical_json(obj))


def json_roundtrip(obj: Any) -> Any:
    """obj as a JSON column reads it back: keys as str, tuples as lists, datetimes as ISO strings.

    The store keeps JSON values in this form, so that what it hashed and compared before a
    write is exactly what a later reader (and the chain verifier) sees.
    """
    # no key sorting needed here: only the values matter, and json.dumps already writes keys as str
    return json.loads(json.dumps(obj, ensure_ascii=False, allow_nan=False, default=_encode_extra))


class ListDigest:
    """digest() of a list, fed one item at a time: canonical JSON writes a list as "[" items joined by "," "]"."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256(b"[")
        self._first = True

    def add(self, item: Any) -> None:
        if not self._first:
            self._sha.update(b",")
        self._first = False
        self._sha.update(canonical_json(item))

    def hexdigest(self) -> str:
        done = self._sha.copy()
        done.update(b"]")
        return done.hexdigest()


# -- stored time -------------------------------------------------------------------------------


def stored_datetime(unix: float) -> dt.datetime:
    """unix seconds as the store keeps them: an aware UTC datetime, rounded half-even to the microsecond."""
    return dt.datetime.fromtimestamp(unix, tz=dt.timezone.utc)


def stored_time(unix: float | None) -> float | None:
    """unix seconds as they read back from the store (rounded to the microsecond)."""
    return None if unix is None else stored_datetime(unix).timestamp()


# -- the event hash chain ----------------------------------------------------------------------


class EventFields(NamedTuple):
    """The hashed fields of one `events` row, in hash order."""

    seq: int
    at: dt.datetime
    kind: str
    request_id: str | None
    payload: dict[str, Any]
    dedup_key: str | None
    instance_id: str | None = None  # hashed only when set, so rows written before the column existed verify unchanged


def hashed_fields(fields: EventFields | tuple[Any, ...]) -> list[Any]:
    """What an event's hash covers: [seq, at, kind, request_id, payload, dedup_key], and instance_id
    after them when the event has one."""
    values = list(fields)
    if len(values) > 6 and values[6] is None:
        del values[6:]
    return values


def event_hash(prev_hash: str, fields: EventFields | tuple[Any, ...]) -> str:
    """sha256 hex of prev_hash (as ASCII hex) followed by canonical_json(hashed_fields(fields))."""
    h = hashlib.sha256(prev_hash.encode("ascii"))
    h.update(canonical_json(hashed_fields(fields)))
    return h.hexdigest()


class ChainedRow(Protocol):
    """What first_break reads from each row: an `events` row (a SQLAlchemy Row fits)."""

    seq: int
    at: dt.datetime
    kind: str
    request_id: str | None
    payload: dict[str, Any]
    dedup_key: str | None
    prev_hash: str
    hash: str


class ChainBreak(NamedTuple):
    """Where and why the chain first fails to verify."""

    seq: int
    reason: str


def first_break(rows: Iterable[ChainedRow], *, after_seq: int = 0, after_hash: str = GENESIS_HASH) -> ChainBreak | None:
    """The first place the chain breaks, reading rows in seq order one at a time, or None.

    Starts after (after_seq, after_hash): the genesis by default, or a trusted checkpoint.
    A missing row is reported at the missing seq; an altered row at its own seq.
    """
    expected_seq, prev = after_seq + 1, after_hash
    for row in rows:
        if row.seq != expected_seq:
            return ChainBreak(expected_seq, f"expected seq {expected_seq}, found seq {row.seq}: rows are missing")
        if row.prev_hash != prev:
            return ChainBreak(row.seq, "prev_hash does not match the previous event's hash")
        fields = EventFields(
            row.seq, row.at, row.kind, row.request_id, row.payload, row.dedup_key, getattr(row, "instance_id", None)
        )
        if event_hash(prev, fields) != row.hash:
            return ChainBreak(row.seq, "hash does not match the event's contents")
        expected_seq, prev = expected_seq + 1, row.hash
    return None


def verify_chain(rows: Iterable[ChainedRow], *, after_seq: int = 0, after_hash: str = GENESIS_HASH) -> int | None:
    """The first bad seq (see first_break), or None if every row verifies."""
    found = first_break(rows, after_seq=after_seq, after_hash=after_hash)
    return None if found is None else found.seq


# -- what request events carry -----------------------------------------------------------------


def prompt_digest(text: str | None, token_ids: Sequence[int]) -> str:
    """A binding's prompt_sha256: of the prompt text when there is one, else of its token ids as compact JSON."""
    if text is not None:
        return text_sha256(text)
    return bytes_sha256(json.dumps(list(token_ids), separators=(",", ":")).encode())


# -- salted commitments to text that may be erased ----------------------------------------------

TEXT_SALT_BYTES = 16


def new_text_salt() -> str:
    """A fresh random salt for one text row: 16 bytes from the OS's CSPRNG, as 32 lowercase hex digits."""
    return secrets.token_hex(TEXT_SALT_BYTES)


def _salt_bytes(salt: str) -> bytes:
    raw = bytes.fromhex(salt)
    if len(raw) != TEXT_SALT_BYTES:
        raise ValueError(f"a text salt is {TEXT_SALT_BYTES} bytes (32 hex digits), got {len(raw)}")
    return raw


def text_commitment(salt: str, text: str) -> str:
    """sha256(salt || utf8(text)): commits to a prompt's or completion's text (and, revision 0016 on, to tool
    definitions, a constraint's text, a completion's tool calls) without revealing it once the salt is gone (salt:
    32 hex digits, used as its 16 bytes)."""
    return bytes_sha256(_salt_bytes(salt) + text.encode("utf-8"))


def token_ids_commitment(salt: str, token_ids: Sequence[int]) -> str:
    """sha256(salt || canonical_json(token_ids)), the same salt as the text's (the ids decode to the text)."""
    return bytes_sha256(_salt_bytes(salt) + canonical_json(list(token_ids)))


def erased_requests_digest(request_ids: Iterable[str]) -> str:
    """An `erased` event's `requests_sha256`: digest of the erased requests' audit keys, sorted (code points)."""
    sha = ListDigest()
    for rid in sorted(request_ids):
        sha.add(rid)
    return sha.hexdigest()


def binding_digest(binding: msgspec.Struct | Mapping[str, Any]) -> str:
    """The `binding_sha256` of a request_admitted event: the binding exactly as the payload carries it."""
    return digest(binding if isinstance(binding, Mapping) else msgspec.to_builtins(binding))


_COMPLETION_TIMES = ("first_token_at", "finished_at")


_SALTED_COMPLETION = ("text_commitment", "token_ids_commitment")


def completion_form(record: msgspec.Struct) -> dict[str, Any]:
    """A completion record as its digest takes it: its fields, times as stored.

    Form v1 (a row without commitments, written before salted text): every field but the commitments.
    Form v2 (`text_commitment` set): the text and token ids are left out, their salted commitments go in.
    In both, `tool_calls` only when it holds calls (completions without, and those before the column, digest as
    before). Form v3 (`tool_calls_commitment` set, revision 0016): the calls are kept apart under a salt, their
    commitment goes in and `tool_calls` (NULL in the row) stays out; without it the key is left out, so v1 and v2
    digest as they did.
    """
    out = msgspec.to_builtins(record)
    for name in _COMPLETION_TIMES:
        out[name] = stored_time(out[name])
    if out.get("text_commitment") is None:
        for name in _SALTED_COMPLETION:
            out.pop(name, None)
    else:
        del out["text"], out["token_ids"]
    if out.get("tool_calls", 0) is None:
        del out["tool_calls"]
    if out.get("tool_calls_commitment", 0) is None:
        del out["tool_calls_commitment"]
    return out


def tools_digest(canonical_tools: str) -> str:
    """A binding's `tools_sha256`: of the request's tool definitions as canonical JSON text (its `tools_text`)."""
    return text_sha256(canonical_tools)


class CompletionsDigest(ListDigest):
    """completions_digest fed one completion at a time, in index order (verify streams rows so)."""

    def add(self, item: Any) -> None:
        super().add(completion_form(item))


def completions_digest(records: Iterable[Any]) -> str:
    """The `completions_sha256` of a request_finished / request_aborted event: its completions in index order,
    times as stored."""
    sha = CompletionsDigest()
    for record in sorted(records, key=lambda r: r.index):
        sha.add(record)
    return sha.hexdigest()


def registration_digest(row_form: Mapping[str, Any]) -> str:
    """The `adapter_sha256` / `instance_sha256` of a registration event: of the row as its payload carries it."""
    return digest(row_form)


# -- fingerprints of what was loaded -----------------------------------------------------------


class FingerprintTensor(Protocol):
    """One tensor of an adapter's safetensors file, as its header and data section give it."""

    name: str
    dtype: str
    shape: Sequence[int]
    data: bytes | bytearray | memoryview | None


def _frame(h: Any, data: bytes | bytearray | memoryview) -> None:
    h.update(len(data).to_bytes(8, "big"))
    h.update(data)


def adapter_fingerprint(config: Mapping[str, Any], tensors: Iterable[FingerprintTensor]) -> str:
    """An adapter's content fingerprint (v1) from its parsed adapter_config.json and its tensors' raw bytes."""
    h = hashlib.sha256()
    _frame(h, ADAPTER_FINGERPRINT_TAG)
    _frame(h, json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    for t in sorted(tensors, key=lambda t: t.name):
        if t.data is None:
            raise ValueError(f"tensor {t.name!r} has no bytes read: the fingerprint covers every tensor's bytes")
        _frame(h, t.name.encode("utf-8"))
        _frame(h, t.dtype.encode("ascii", "backslashreplace"))
        _frame(h, json.dumps(list(t.shape), separators=(",", ":")).encode("ascii"))
        _frame(h, t.data)
    return h.hexdigest()


def base_model_fingerprint(config: Mapping[str, Any], weight_files: Iterable[Path]) -> str:
    """A base model's fingerprint from its parsed config.json and its weight files (read here, in name order)."""
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for path in sorted(weight_files, key=lambda p: p.name):
        h.update(b"\0" + path.name.encode() + b"\0")
        with path.open("rb") as fh:
            while chunk := fh.read(_FILE_CHUNK):
                h.update(chunk)
    return h.hexdigest()


# -- report bundles ----------------------------------------------------------------------------


class FileDigest:
    """A file's sha256 taken while it is written, so it costs no second read."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._sha.update(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 hex of a file's bytes (a report bundle's files; a manifest's predecessor)."""
    sha = FileDigest()
    with open(path, "rb") as file:
        while chunk := file.read(_FILE_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def report_signed_message(manifest: Mapping[str, Any]) -> bytes:
    """What a report's signature covers: its manifest without the `signature` entry, as canonical JSON."""
    return canonical_json({k: v for k, v in manifest.items() if k != "signature"})


# -- evidence: the Merkle tree, signed-note key ids, receipts (EVIDENCE.md) -------------------------------------

MERKLE_EMPTY_ROOT = hashlib.sha256(b"").digest()  # RFC 9162: the hash of the empty tree


def merkle_leaf_hash(data: bytes) -> bytes:
    """RFC 9162 leaf hash: SHA-256(0x00 || data). An event's leaf: data = the 32 bytes of its chain hash."""
    return hashlib.sha256(b"\x00" + data).digest()


def merkle_node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 9162 interior node: SHA-256(0x01 || left || right)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def note_key_id(name: str, key_type: int, public: bytes) -> bytes:
    """C2SP signed-note key id: SHA-256(name || 0x0A || key type || public key)[:4] (0x01 Ed25519, 0x04 cosignature/v1)."""
    return hashlib.sha256(name.encode() + b"\n" + bytes([key_type]) + public).digest()[:4]


def token_ids_sha256(token_ids: Sequence[int]) -> str:
    """A receipt's digest of a completion's token ids: SHA-256 of their canonical JSON list (`[1,2,3]`)."""
    return hashlib.sha256(canonical_json(list(token_ids))).hexdigest()
