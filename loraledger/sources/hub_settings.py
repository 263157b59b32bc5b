"""HubSettings: where and how the Hub is reached (endpoint, cache, token, offline), read from the environment when used.

huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is imported;
an engine reads them each time it resolves a repo, so a process that sets them after importing
loraledger (a test, a notebook) gets what it set. The variables mean what they mean to huggingface_hub.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

_TRUE = ("1", "true", "yes", "on")
DEFAULT_ENDPOINT = "https://huggingface.co"


class HubSettings(msgspec.Struct, frozen=True, kw_only=True):
    endpoint: str
    cache_dir: str
    token: str | None  # None: huggingface_hub's own lookup (the token `hf auth login` saved)
    offline: bool
    timeout: float  # seconds one resolution (metadata and every download) may take in all
    max_bytes: int  # the most bytes one resolution may download

    @classmethod
    def from_env(cls, *, timeout: float, max_bytes: int, cache_dir: str | None = None) -> HubSettings:
        """cache_dir: EngineArgs.download_dir (vLLM's name); default HF_HUB_CACHE, else $HF_HOME/hub, else
        huggingface_hub's default (~/.cache/huggingface/hub)."""
        return cls(
            endpoint=(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
            cache_dir=str(Path(cache_dir or _default_cache()).expanduser()),
            token=os.environ.get("HF_TOKEN") or None,
            offline=os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE,
            timeout=float(timeout),
            max_bytes=int(max_bytes),
        )


def _default_cache() -> str:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.environ[name]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
