"""Where models, tokenizers and adapters come from: a local folder, or a Hugging Face Hub repo at a resolved commit."""

from loraledger.sources.hub_errors import (
    HubAccessError,
    HubError,
    HubNotFoundError,
    HubOfflineError,
    HubTimeoutError,
    HubTooLargeError,
    HubUnavailableError,
)
from loraledger.sources.hub_settings import HubSettings
from loraledger.sources.source import Source, parse_pinned, resolve

__all__ = [
    "HubAccessError",
    "HubError",
    "HubNotFoundError",
    "HubOfflineError",
    "HubSettings",
    "HubTimeoutError",
    "HubTooLargeError",
    "HubUnavailableError",
    "Source",
    "parse_pinned",
    "resolve",
]
