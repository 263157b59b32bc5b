"""RayServeArgs: the `args:` of a Ray Serve config's loraledger application (model, adapters folder, keys, audit
database, engine arguments), checked before any replica starts; the ServerConfig every replica serves with.

Ray's own part of the config file (num_replicas, autoscaling_config, ray_actor_options such as num_gpus) is Ray's;
these are the application's. Nothing here imports Ray.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from loraledger.engine_args import EngineArgs
from loraledger.errors import ConfigError
from loraledger.server.server_config import DEFAULT_GRACE_SECONDS, DEFAULT_MAX_BODY_BYTES, ServerConfig

SHARED_DIALECTS = ("postgresql",)  # databases every replica, on every node, can write at once


class RayServeArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str  # the checkpoint folder, at the same path on every node
    audit_url: str  # the one audit database all replicas write (PostgreSQL)
    adapters_dir: str | None = None  # adapters by name: <adapters_dir>/<name>/ (PEFT files), read by every replica
    api_keys_file: str | None = None  # the keys file (`loraledger keys add`), at the same path on every node
    insecure_no_auth: bool = False  # serve without keys: anyone who reaches Ray's proxy may use every model
    served_model_name: list[str] = msgspec.field(
        default_factory=list
    )  # the base model's names (default: the model path)
    engine: dict[str, object] = msgspec.field(
        default_factory=dict
    )  # further EngineArgs fields (max_loras, max_cpu_loras, dtype...)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_grace_seconds: float = DEFAULT_GRACE_SECONDS
    max_pending_requests: int | None = None
    trust_request_chat_template: bool = False
    # true: an adapter's requests go to replicas that hold it (Ray's multiplexed routing); false: to any replica
    # (Ray's request router alone), the baseline that bench.scale_out compares affinity with
    adapter_affinity: bool = True

    @classmethod
    def parse(cls, args: object) -> RayServeArgs:
        """The application's `args` (a mapping), checked: a wrong or missing field is a ConfigError naming it."""
        try:
            parsed = msgspec.convert(args, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"the loraledger application's args in the Ray Serve config: {exc}") from None
        parsed.check()
        return parsed

    def check(self) -> None:
        scheme = self.audit_url.split(":", 1)[0].split("+", 1)[0]
        if scheme not in SHARED_DIALECTS:
            raise ConfigError(
                f"audit_url {scheme!r}: every replica writes the one audit database, so it must be PostgreSQL "
                "(postgresql+psycopg://user@host/db); a SQLite file cannot be shared by replicas on several nodes"
            )
        if self.api_keys_file is None and not self.insecure_no_auth:
            raise ConfigError(
                "no api_keys_file: Ray's proxy answers on every node, so a deployment without keys would let anyone who "
                "reaches it use every adapter. Give api_keys_file (make keys with `loraledger keys add`) or set "
                "insecure_no_auth: true"
            )
        if "model" in self.engine or "audit_url" in self.engine:
            raise ConfigError("give model and audit_url at the top of args, not under engine")
        args = self.engine_args()  # a bad engine argument is refused here, not in every replica
        if self.adapters_dir is not None and not args.enable_lora:
            raise ConfigError("adapters_dir needs an engine with enable_lora: true (leave it out: it is on by default)")

    def engine_args(self) -> EngineArgs:
        engine = {"enable_lora": True, **self.engine}
        try:
            return EngineArgs(model=self.model, audit_url=self.audit_url, **engine)
        except TypeError as exc:
            raise ConfigError(f"engine: {exc}") from None

    def server_config(self) -> ServerConfig:
        return ServerConfig(
            engine_args=self.engine_args(),
            served_model_name=tuple(self.served_model_name),
            api_keys_file=self.api_keys_file,
            insecure_no_auth=True,  # the proxy's address is Ray's; check() has required keys or this explicit choice
            host="0.0.0.0",
            max_body_bytes=self.max_body_bytes,
            shutdown_grace_seconds=self.shutdown_grace_seconds,
            max_pending_requests=self.max_pending_requests,
            trust_request_chat_template=self.trust_request_chat_template,
        )

    @property
    def adapters_per_replica(self) -> int:
        """Ray's max_num_models_per_replica: the adapters a replica keeps in host memory (max_cpu_loras)."""
        return self.engine_args().cpu_lora_capacity


class AdapterFolder:
    """The adapters a deployment serves: each subfolder of one folder (shared by every node) is an adapter named
    after it."""

    def __init__(self, root: str | None) -> None:
        self.root = Path(root) if root is not None else None

    def path(self, name: str) -> Path | None:
        """The folder of adapter `name`, or None when there is no such adapter (or the name is not a plain folder
        name: a request never reaches outside the adapters folder)."""
        if (
            self.root is None
            or not name
            or name in (".", "..")
            or name.startswith(".")
            or "/" in name
            or "\\" in name
            or "\0" in name
        ):
            return None
        path = self.root / name
        return path if (path / "adapter_config.json").is_file() else None
