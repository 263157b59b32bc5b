"""huggingface_hub's exceptions (and its HTTP client's) as HubErrors that name the repo, the revision and the fix."""

from __future__ import annotations

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


def stopped(why: str, repo_id: str, revision: str, settings: HubSettings) -> HubError:
    if why == "size":
        return HubTooLargeError(
            f"the Hub sent more than the limit of {settings.max_bytes} bytes; raise max_download_bytes "
            "(max_lora_download_bytes for adapters) if that is expected",
            repo_id=repo_id,
            revision=revision,
        )
    return HubTimeoutError(
        f"the download passed its deadline of {settings.timeout:g} s; raise download_timeout (lora_download_timeout "
        "for adapters)",
        repo_id=repo_id,
        revision=revision,
    )


def typed(exc: Exception, repo_id: str, revision: str, settings: HubSettings) -> HubError:
    """huggingface_hub's (and its HTTP client's) exceptions as HubErrors that say what to do."""
    from huggingface_hub import errors as hf

    where = dict(repo_id=repo_id, revision=revision)
    names = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, hf.GatedRepoError):
        return HubAccessError(
            f"the repo is gated: accept its conditions on the Hub and set HF_TOKEN to a token of that account ({exc})",
            **where,
        )
    if isinstance(exc, hf.RevisionNotFoundError):
        return HubNotFoundError(f"the repo has no such revision (branch, tag or commit); check it ({exc})", **where)
    if isinstance(exc, hf.RepositoryNotFoundError):
        return HubNotFoundError(
            "no such repo on the Hub at "
            f"{settings.endpoint}, nor a local folder of that name; check the name, give the folder's path, or, for a "
            "private repo, set HF_TOKEN",
            **where,
        )
    if isinstance(exc, getattr(hf, "RemoteEntryNotFoundError", ())) or isinstance(
        exc, getattr(hf, "EntryNotFoundError", ())
    ):
        return HubNotFoundError(f"a file the listing named is not there ({exc}); try again", **where)
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return HubOfflineError(
            "huggingface_hub is in offline mode (HF_HUB_OFFLINE was set when it was imported); set HF_HUB_OFFLINE=1 "
            "to use the cache, or unset it before starting",
            **where,
        )
    if isinstance(exc, hf.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return HubAccessError(
                f"the Hub refused access (HTTP {status}); set HF_TOKEN to a token allowed to read the repo", **where
            )
        return HubUnavailableError(
            f"the Hub at {settings.endpoint} answered HTTP {status}; try again later ({exc})", **where
        )
    if names & {"TimeoutException", "Timeout", "TimeoutError", "ReadTimeout", "ConnectTimeout"}:
        return HubTimeoutError(
            f"the Hub at {settings.endpoint} did not answer in time ({type(exc).__name__}); try again, or set "
            "HF_HUB_OFFLINE=1 to use the cache",
            **where,
        )
    if isinstance(exc, OSError) or names & {"ConnectError", "NetworkError", "TransportError", "RemoteProtocolError"}:
        return HubUnavailableError(
            f"the Hub at {settings.endpoint} cannot be reached ({type(exc).__name__}: {exc}); check the network and "
            "HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the cache",
            **where,
        )
    return HubUnavailableError(f"the fetch failed ({type(exc).__name__}: {exc})", **where)
