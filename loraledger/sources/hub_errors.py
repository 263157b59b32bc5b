"""HubError and its kinds: why a Hub repo could not be resolved or fetched, naming the repo, the revision and the fix."""

from __future__ import annotations

from loraledger.errors import LoraLedgerError


class HubError(LoraLedgerError):
    """A Hugging Face Hub repo could not be resolved or fetched; carries the repo id and the revision asked for."""

    def __init__(self, message: str, *, repo_id: str, revision: str | None) -> None:
        super().__init__(f"{message} (Hub repo {repo_id!r} at revision {revision or 'main'!r})")
        self.repo_id = repo_id
        self.revision = revision


class HubNotFoundError(HubError):
    """No such repo, revision, or file the load needs in it."""


class HubAccessError(HubError):
    """The repo is gated or private and the token (HF_TOKEN) is missing or not allowed."""


class HubOfflineError(HubError):
    """Offline (HF_HUB_OFFLINE=1) and the revision is not complete in the local Hub cache."""


class HubTimeoutError(HubError):
    """Resolving or downloading took longer than its deadline."""


class HubTooLargeError(HubError):
    """The files to download are larger than the size limit."""


class HubUnavailableError(HubError):
    """The Hub endpoint could not be reached or answered with a server error."""
