"""API keys: the keys file (TOML), constant-time checks, per-key rate limits, and the `Depends` that yields the caller.

The keys file holds, per key, its sha256 (never the key), an id, the tenant it speaks for, the models it may
use (adapter names or globs; the base model's served name is one of them) and a role:

    [[keys]]
    id = "key-3f9a1c2b"
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    tenant = "acme"
    adapters = ["sql", "support-*"]
    role = "user"            # or "admin": may also load and unload adapters
    rate_limit = "120/minute" # optional: requests per second, minute or hour

The audit binding's tenant and key id come from the key that authenticated the request, never from its body.
`KeyRing.reload()` swaps in a new file whole (SIGHUP), or keeps the old one when the new one is bad.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import tomllib
from fastapi import Request

from loraledger.errors import ConfigError
from loraledger.server.error_responses import APIError

ROLES = ("user", "admin")
_PERIODS = {"second": 1.0, "minute": 60.0, "hour": 3600.0}
_KEY_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_KEY_CHARS = 256


@dataclass(frozen=True)
class RateLimit:
    requests: int
    period: float  # seconds

    @classmethod
    def parse(cls, text: str) -> RateLimit:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(second|minute|hour)\s*", str(text))
        if m is None or int(m.group(1)) < 1:
            raise ConfigError(f"rate limit {text!r}: write N/second, N/minute or N/hour with N >= 1")
        return cls(int(m.group(1)), _PERIODS[m.group(2)])

    def __str__(self) -> str:
        unit = next(name for name, seconds in _PERIODS.items() if seconds == self.period)
        return f"{self.requests}/{unit}"


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    sha256: str
    tenant: str
    adapters: tuple[str, ...]  # names or globs (fnmatch) of the models this key may use
    role: str = "user"
    rate_limit: RateLimit | None = None


@dataclass(frozen=True)
class Caller:
    """Who is calling: from the key that authenticated the request (or the anonymous caller of a server without keys)."""

    tenant: str | None
    key_id: str | None
    role: str
    adapters: tuple[str, ...]

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def may_use(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.adapters)


# a server without keys (loopback, or --insecure-no-auth): every model, no admin routes, no tenant
ANONYMOUS = Caller(tenant=None, key_id=None, role="user", adapters=("*",))


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def read_keys_file(path: str | os.PathLike) -> tuple[ApiKey, ...]:
    """Parse and check a keys file; ConfigError naming the entry and the problem."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the keys file {str(path)!r}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"the keys file {str(path)!r} is not valid TOML: {exc}") from None
    unknown = set(data) - {"keys"}
    entries = data.get("keys", [])
    if unknown or not isinstance(entries, list):
        raise ConfigError(
            f"the keys file {str(path)!r} must hold [[keys]] tables only (found {sorted(unknown) or type(entries).__name__})"
        )
    keys: list[ApiKey] = []
    for i, entry in enumerate(entries):
        keys.append(_entry(entry, f"{path}: [[keys]] #{i + 1}"))
    ids = [k.key_id for k in keys]
    hashes = [k.sha256 for k in keys]
    if len(set(ids)) != len(ids) or len(set(hashes)) != len(hashes):
        raise ConfigError(f"the keys file {str(path)!r} has a key id or a key hash twice; each key needs its own")
    return tuple(keys)


def _entry(entry: object, where: str) -> ApiKey:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: not a table")
    unknown = set(entry) - {"id", "sha256", "tenant", "adapters", "role", "rate_limit", "created"}
    if unknown:
        raise ConfigError(f"{where}: unknown fields {sorted(unknown)}")
    key_id, sha, tenant = entry.get("id"), entry.get("sha256"), entry.get("tenant")
    adapters, role = entry.get("adapters"), entry.get("role", "user")
    if not isinstance(key_id, str) or not _KEY_ID.match(key_id):
        raise ConfigError(f"{where}: id must be 1-64 characters of letters, digits and _.:-, got {key_id!r}")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise ConfigError(f"{where} ({key_id}): sha256 must be the key's sha256 as 64 lowercase hex digits")
    if not isinstance(tenant, str) or not tenant or len(tenant) > 256:
        raise ConfigError(f"{where} ({key_id}): tenant must be a non-empty string of at most 256 characters")
    if not isinstance(adapters, list) or not adapters or not all(isinstance(a, str) and a for a in adapters):
        raise ConfigError(
            f'{where} ({key_id}): adapters must be a non-empty list of model names or globs ("*": every model)'
        )
    if role not in ROLES:
        raise ConfigError(f"{where} ({key_id}): role must be one of {', '.join(ROLES)}, got {role!r}")
    limit = entry.get("rate_limit")
    return ApiKey(
        key_id=key_id, sha256=sha, tenant=tenant, adapters=tuple(adapters), role=role,
        rate_limit=None if limit is None else RateLimit.parse(limit),
    )  # fmt: skip


class KeyRing:
    """The keys the server accepts. `authenticate` compares the presented key's hash with every entry's in constant
    time (hmac.compare_digest, no early exit), so timing says nothing about which entry, or how much of one, matched."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._keys: tuple[ApiKey, ...] = read_keys_file(self.path)
        self._log = structlog.get_logger().bind(actor="server")

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, presented: str) -> ApiKey | None:
        digest = key_sha256(presented).encode()
        found = None
        for key in self._keys:  # every entry, whatever matched
            if hmac.compare_digest(digest, key.sha256.encode()):
                found = key
        return found

    def reload(self) -> bool:
        """Read the file again and swap it in whole; a bad file is logged and the old keys stay. Requests in flight
        keep the caller they were authenticated as."""
        try:
            keys = read_keys_file(self.path)
        except ConfigError as exc:
            self._log.error("keys file not reloaded; the previous keys stay in force", error=str(exc))
            return False
        if not keys:  # an empty file (or one caught half-written) would lock every tenant out
            self._log.error(
                "keys file not reloaded: it holds no keys (empty, or still being written); the previous keys stay in force",
                path=self.path,
            )
            return False
        self._keys = keys  # one reference swap: a request sees the old set or the new one
        self._log.info("keys file reloaded", keys=len(keys))
        return True


class RateLimiter:
    """A token bucket per key id: `requests` per `period`, bursts up to `requests`."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, last refill)
        self._lock = threading.Lock()

    def take(self, key_id: str, limit: RateLimit) -> float:
        """0 when the request may go; else the seconds until it could."""
        rate = limit.requests / limit.period
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(key_id, (float(limit.requests), now))
            tokens = min(float(limit.requests), tokens + (now - last) * rate)
            if tokens >= 1.0:
                self._buckets[key_id] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key_id] = (tokens, now)
            return (1.0 - tokens) / rate


def bearer_key(request: Request) -> str | None:
    """The key of `Authorization: Bearer <key>`, or None."""
    return parse_bearer(request.headers.get("authorization"))


def parse_bearer(header: str | None) -> str | None:
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def presented_key(state, header: str | None) -> ApiKey | None:
    """The key an Authorization header presents, checked (None on a server without keys); 401, counted, otherwise.
    The server's middleware calls it before a body is read, so a caller without a key never holds a request slot."""
    ring: KeyRing | None = state.keys
    if ring is None:
        return None
    presented = parse_bearer(header)
    if presented is None:
        state.metrics.auth_failures.labels(reason="missing").inc()
        raise unauthorized("no API key: send it as `Authorization: Bearer <key>` (the openai client's api_key)")
    key = ring.authenticate(presented) if len(presented) <= MAX_KEY_CHARS else None
    if key is None:
        state.metrics.auth_failures.labels(reason="invalid").inc()
        raise unauthorized("the API key is not valid")  # the key itself is never logged
    return key


async def authenticate(request: Request) -> Caller:
    """The caller of this request (FastAPI dependency): its key checked, counted when bad, rate-limited."""
    state = request.app.state.server
    if state.keys is None:
        caller = ANONYMOUS
    else:
        key = presented_key(state, request.headers.get("authorization"))
        if key.rate_limit is not None:
            wait = state.limiter.take(key.key_id, key.rate_limit)
            if wait > 0:
                state.metrics.rate_limited.labels(tenant=key.tenant).inc()
                raise APIError(
                    429, f"rate limit of key {key.key_id} reached ({key.rate_limit}); retry in {wait:.1f} s",
                    type="requests", code="rate_limit_exceeded", headers={"Retry-After": str(max(1, int(wait + 0.999)))},
                )  # fmt: skip
        caller = Caller(tenant=key.tenant, key_id=key.key_id, role=key.role, adapters=key.adapters)
    structlog.contextvars.bind_contextvars(tenant=caller.tenant, key_id=caller.key_id)
    return caller


async def require_admin(request: Request) -> Caller:
    caller = await authenticate(request)
    if not caller.is_admin:
        reason = (
            "this server has no API keys" if caller.key_id is None else f"key {caller.key_id} has role {caller.role!r}"
        )
        raise APIError(
            403,
            f"loading and unloading adapters needs an admin key; {reason}",
            type="permission_error",
            code="admin_only",
        )
    return caller


# --- the keys file, written by `loraledger keys add` -----------------------------------------------


def new_key() -> tuple[str, str]:
    """(key id, key): the key is shown once; the file keeps its sha256."""
    return f"key-{secrets.token_hex(4)}", f"ll-{secrets.token_urlsafe(32)}"


def _toml_str(value: str) -> str:
    import json

    return json.dumps(value, ensure_ascii=True)  # a JSON string with ASCII escapes is a TOML basic string


def add_key(
    path: str | os.PathLike, *, tenant: str, adapters: list[str], admin: bool = False, rate_limit: str | None = None
) -> tuple[str, str]:
    """Append a new key to the keys file (made, mode 0600, if missing); returns (key id, key)."""
    path = Path(path)
    existing = read_keys_file(path) if path.exists() else ()
    key_id, key = new_key()
    while any(k.key_id == key_id for k in existing):
        key_id, key = new_key()
    entry = {
        "id": key_id,
        "sha256": key_sha256(key),
        "tenant": tenant,
        "adapters": adapters,
        "role": "admin" if admin else "user",
    }
    if rate_limit is not None:
        entry["rate_limit"] = str(RateLimit.parse(rate_limit))
    _entry(entry, "the new key")  # the same checks as reading the file
    lines = ["", "[[keys]]"]
    for name, value in entry.items():
        if isinstance(value, list):
            lines.append(f"{name} = [{', '.join(_toml_str(v) for v in value)}]")
        else:
            lines.append(f"{name} = {_toml_str(value)}")
    lines.append(f"created = {_toml_str(time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()))}")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    read_keys_file(path)  # the file as a whole still reads
    return key_id, key
