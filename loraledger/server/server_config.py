"""ServerConfig: what `loraledger serve` serves and how (the engine's EngineArgs, names, adapters, keys, limits)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from loraledger.engine_args import EngineArgs
from loraledger.errors import ConfigError
from loraledger.server.limits import ServerLimits
from loraledger.server.lora_resolvers import DEFAULT_MAX_LORAS, LoRAResolverSpec
from loraledger.server.tools.parsers import PARSERS

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a request body above this is refused (413) before it is read whole
DEFAULT_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class LoRAModule:
    """An adapter served from start: `--lora-modules name=path` (vLLM's flag); path may be a Hub repo id,
    `org/name` or `org/name@revision`."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """vLLM's forms: `name=path`, or JSON `{"name": ..., "path": ...}`."""
        import json

        if text.lstrip().startswith("{"):
            try:
                data = json.loads(text)
                return cls(name=str(data["name"]), path=str(data["path"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"--lora-modules {text!r}: a JSON module needs 'name' and 'path' ({exc})") from None
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules {text!r}: give name=path")
        return cls(name=name, path=path)


@dataclass(frozen=True)
class ServerConfig:
    engine_args: EngineArgs
    served_model_name: tuple[
        str, ...
    ] = ()  # the base model's names in requests (the first in responses); default: the model path
    lora_modules: tuple[LoRAModule, ...] = ()
    # where an adapter a request names, not loaded yet, is loaded from on first use (loraledger.server.lora_resolvers)
    lora_resolvers: tuple[LoRAResolverSpec, ...] = ()
    lora_resolver_max_loras: int = DEFAULT_MAX_LORAS  # adapters each resolver may load at most
    api_keys_file: str | None = None  # TOML (loraledger.server.auth); None: no keys, loopback only
    insecure_no_auth: bool = False  # serve without keys on an address other than loopback
    host: str = "127.0.0.1"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_grace_seconds: float = DEFAULT_GRACE_SECONDS  # SIGTERM: running requests get this long to finish
    max_pending_requests: int | None = (
        None  # requests in flight above which new ones get 503 (default: 4 x max_num_seqs)
    )
    max_prompts_per_request: int = 64  # /v1/completions: prompts in one body
    trust_request_chat_template: bool = False  # let a request's `chat_template` (Jinja) render its conversation
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse the calls the model writes (vLLM's flag)
    tool_call_parser: str | None = None  # the format they are parsed from: hermes, qwen, qwen3, llama3_json, mistral
    root_path: str = ""
    limits: ServerLimits = field(default_factory=ServerLimits)  # per-request counts, sizes and waits on clients
    extra: dict = field(default_factory=dict)  # reserved for hosts that mount the routes (Ray Serve)

    def __post_init__(self) -> None:
        if not isinstance(self.engine_args, EngineArgs):
            raise ConfigError("ServerConfig.engine_args must be an EngineArgs")
        if self.enable_auto_tool_choice and self.tool_call_parser not in PARSERS:
            raise ConfigError(
                f"--enable-auto-tool-choice needs --tool-call-parser, one of {sorted(PARSERS)}; "
                f"got {self.tool_call_parser!r}"
            )
        names = self.served_model_name or (str(self.engine_args.model),)
        object.__setattr__(self, "served_model_name", tuple(names))
        modules = [m.name for m in self.lora_modules]
        clash = sorted(set(modules) & set(self.served_model_name)) or sorted(
            {m for m in modules if modules.count(m) > 1}
        )
        if clash:
            raise ConfigError(
                f"model name(s) {clash} are given twice (an adapter and the base model, or two adapters); each name must be unique"
            )
        if self.lora_modules and not self.engine_args.enable_lora:
            raise ConfigError("--lora-modules needs an engine with enable_lora=True (--enable-lora)")
        if self.lora_resolvers and not self.engine_args.enable_lora:
            raise ConfigError("--lora-resolver needs an engine with enable_lora=True (--enable-lora)")
        if not isinstance(self.lora_resolver_max_loras, int) or self.lora_resolver_max_loras < 1:
            raise ConfigError(
                f"--lora-resolver-max-loras must be an integer >= 1, got {self.lora_resolver_max_loras!r}"
            )
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be an integer >= 1024, got {self.max_body_bytes!r}")
        if not self.shutdown_grace_seconds >= 0:
            raise ConfigError(f"the shutdown grace period must be >= 0 seconds, got {self.shutdown_grace_seconds!r}")
        check_bind(self.host, self.api_keys_file is not None, self.insecure_no_auth)

    @property
    def model_name(self) -> str:
        return self.served_model_name[0]

    @property
    def pending_limit(self) -> int:
        return self.max_pending_requests if self.max_pending_requests is not None else 4 * self.engine_args.max_num_seqs


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, has_keys: bool, insecure_no_auth: bool) -> None:
    """Secure by default: without API keys, only loopback, unless --insecure-no-auth says otherwise."""
    if not has_keys and not insecure_no_auth and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve on {host!r} without API keys: anyone who can reach it could use every adapter. Give "
            "--api-keys keys.toml (make keys with `loraledger keys add`), bind 127.0.0.1, or pass --insecure-no-auth"
        )
