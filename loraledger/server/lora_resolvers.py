"""LoRA resolvers (`serve --lora-resolver`): where an adapter a request names, not loaded yet, is looked for.

As vLLM's LoRA resolver plugins (its filesystem and Hub resolvers): a folder whose subfolders are adapters (the name
is the subfolder), or a Hub organisation (`hf://ORG`: the name `NAME` is the repo `ORG/NAME`, `NAME@rev` pins a
revision: a branch, tag or commit sha without '/'). Resolvers are tried in the order given; the first that has the
name serves it. Unlike vLLM, the adapter's `base_model_name_or_path` need not equal the served model's name (a Hub
id and a local folder of the same model differ): the loader's shape checks refuse an adapter of another model. Each
resolver loads at most `max_loras` adapters (an adapter unloaded gives its place back).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from loraledger.errors import ConfigError
from loraledger.sources import parse_pinned

HUB_SCHEME = "hf://"
DEFAULT_MAX_LORAS = 64  # adapters one resolver may load into a server (--lora-resolver-max-loras)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")  # one path component; never "." or "..", never a slash
_ORG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# a revision a caller names (`NAME@rev`): a branch, tag or commit sha, one component; no path (refs/pr/N, which anyone
# may push to on a public repo, or "../.." into the Hub cache)
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class LoRAResolverSpec:
    """One `--lora-resolver`: a local folder of adapters, or (hub=True) a Hub organisation."""

    location: str
    hub: bool = False

    @classmethod
    def parse(cls, text: str) -> LoRAResolverSpec:
        if text.startswith(HUB_SCHEME):
            org = text.removeprefix(HUB_SCHEME).strip("/")
            if not _ORG.fullmatch(org) or ".." in org or "--" in org:
                raise ConfigError(f"--lora-resolver {text!r}: give hf://ORG with ORG a Hub user or organisation name")
            return cls(org, hub=True)
        folder = Path(text).expanduser()
        if not text or not folder.is_dir():
            raise ConfigError(f"--lora-resolver {text!r}: no such folder; give a folder of adapters or hf://ORG")
        return cls(str(folder.absolute()))  # a relative ORG/NAME path would read as a Hub repo id where it is absent

    def __str__(self) -> str:
        return f"{HUB_SCHEME}{self.location}" if self.hub else self.location

    def path_for(self, name: str) -> str | None:
        """The lora_path `name` has here, or None when it names no adapter here. A folder resolver reads the disk
        (call it off the event loop); a Hub resolver reads no adapter (the adapter loader's fetch finds out) and
        names none where a folder at its relative path ORG/NAME exists in the working directory: the loader reads a
        local path first, so that folder would be served under the organisation's name."""
        base, at, revision = name.partition("@")
        if not _NAME.fullmatch(base) or ".." in base:
            return None
        if self.hub:
            if "--" in base or (at and (not _REVISION.fullmatch(revision) or ".." in revision)):
                return None
            candidate = f"{self.location}/{name}"
            if Path(candidate).exists() or Path(self.location, base).exists():
                return None
            try:
                return candidate if parse_pinned(candidate) is not None else None
            except ConfigError:
                return None
        if at:
            return None  # a folder holds one version of each adapter
        folder = Path(self.location) / base
        return str(folder) if (folder / "adapter_config.json").is_file() else None


class LoRAResolvers:
    """The server's resolvers and what each has loaded (name -> resolver index), against each one's limit."""

    def __init__(self, specs: tuple[LoRAResolverSpec, ...], max_loras: int) -> None:
        self.specs = specs
        self.max_loras = max_loras
        self._loaded: dict[str, int] = {}

    def candidates(self, name: str) -> list[tuple[int, str]]:
        """(resolver index, lora_path) of each resolver that may have `name`, in order. Reads folders: off the loop."""
        out = []
        for index, spec in enumerate(self.specs):
            path = spec.path_for(name)
            if path is not None:
                out.append((index, path))
        return out

    def count(self, index: int) -> int:
        return sum(1 for i in self._loaded.values() if i == index)

    def full(self, index: int) -> bool:
        return self.count(index) >= self.max_loras

    def took(self, name: str, index: int) -> None:
        self._loaded[name] = index

    def forget(self, name: str) -> None:
        self._loaded.pop(name, None)
