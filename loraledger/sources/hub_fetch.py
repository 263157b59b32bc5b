"""Fetch one repo revision into the Hub cache with huggingface_hub, under a deadline and a size limit.

Online: the revision is resolved to its commit once (model_info), the files the kind needs are chosen
from that commit's listing (fileset.py), their sizes checked against the limit before a byte is
fetched, and each is downloaded at that commit, so a branch that moves meanwhile cannot mix two
commits. Bytes are counted as they arrive (a server may send more than it listed) and the deadline is
checked with every chunk. The ref (refs/<revision>) is written last, so a fetch cut short leaves no
ref to a partial snapshot. Offline (HF_HUB_OFFLINE=1): the cache's ref and snapshot only, and a
snapshot that lacks a needed file is refused, never loaded.

The whole fetch runs in a thread of its own that the caller waits for until the deadline: a Hub
that stops answering cannot hold the caller past it (the abandoned thread stops at its next chunk, or
when huggingface_hub's own read timeout fires).
"""

from __future__ import annotations

import time
from pathlib import Path

from loraledger.logging import get_logger
from loraledger.sources import fileset, hub_cache
from loraledger.sources.hub_budget import Budget, Stop, run_within
from loraledger.sources.hub_error_map import stopped, typed
from loraledger.sources.hub_errors import (
    HubError,
    HubNotFoundError,
    HubOfflineError,
    HubTimeoutError,
    HubTooLargeError,
    HubUnavailableError,
)
from loraledger.sources.hub_settings import HubSettings

_METADATA_TIMEOUT = 10.0  # seconds one metadata request may wait for an answer (within the deadline)


def fetch(repo_id: str, revision: str, kind: str, settings: HubSettings) -> tuple[Path, str]:
    """(the snapshot folder, its commit sha) of `repo_id` at `revision`, with every file a `kind` needs in it."""
    if settings.offline:
        return _from_cache(repo_id, revision, kind, settings)
    started = time.monotonic()
    folder, commit = run_within(
        settings.timeout,
        lambda stop: _download(repo_id, revision, kind, settings, Budget(started + settings.timeout, settings, stop)),
        lambda: HubTimeoutError(
            f"resolving and downloading took longer than its deadline of {settings.timeout:g} s; raise "
            "download_timeout (lora_download_timeout for adapters), or fetch it ahead of time (`hf download`) and "
            "set HF_HUB_OFFLINE=1",
            repo_id=repo_id,
            revision=revision,
        ),
    )
    get_logger("hub").info("hub revision resolved", repo=repo_id, revision=revision, commit=commit, kind=kind)
    return folder, commit


def _from_cache(repo_id: str, revision: str, kind: str, settings: HubSettings) -> tuple[Path, str]:
    commit = hub_cache.cached_commit(settings.cache_dir, repo_id, revision)
    if commit is None:
        raise HubOfflineError(
            f"HF_HUB_OFFLINE is set and the Hub cache at {settings.cache_dir} holds no snapshot of this revision; "
            "download it once online (or `hf download` it), or unset HF_HUB_OFFLINE",
            repo_id=repo_id,
            revision=revision,
        )
    folder = hub_cache.snapshot(settings.cache_dir, repo_id, commit)
    lacking = fileset.missing(kind, folder)
    if lacking:
        raise HubOfflineError(
            f"HF_HUB_OFFLINE is set and the cached snapshot of commit {commit} lacks {', '.join(lacking)} (a download "
            "that did not finish); fetch it again online, or unset HF_HUB_OFFLINE",
            repo_id=repo_id,
            revision=revision,
        )
    return folder, commit


def _download(repo_id: str, revision: str, kind: str, settings: HubSettings, budget: Budget) -> tuple[Path, str]:
    from huggingface_hub import HfApi

    try:
        api = HfApi(endpoint=settings.endpoint, token=settings.token)
        info = api.model_info(
            repo_id, revision=revision, files_metadata=True, timeout=min(_METADATA_TIMEOUT, budget.remaining())
        )
        commit = info.sha
        if not isinstance(commit, str) or not hub_cache.COMMIT.fullmatch(commit):
            raise HubUnavailableError(
                f"the Hub at {settings.endpoint} named no commit for this revision (got {commit!r}); check HF_ENDPOINT",
                repo_id=repo_id,
                revision=revision,
            )
        sizes = {s.rfilename: _size(s) for s in info.siblings or ()}
        _check_listing(kind, sizes, repo_id, revision, commit)
        folder = hub_cache.snapshot(settings.cache_dir, repo_id, commit)
        fetched = _Fetched(repo_id, revision, commit, sizes, settings, budget)
        fetched.get(fileset.small_files(kind, sizes))
        if kind == fileset.MODEL:
            weights = fileset.model_weights(sizes, fileset.read_index(folder))
            absent = [w for w in weights if w not in sizes]
            if absent or not weights:
                raise HubNotFoundError(
                    f"commit {commit} has no safetensors weights to load ({', '.join(absent) or 'none listed'}); "
                    "only safetensors checkpoints are loaded",
                    repo_id=repo_id,
                    revision=revision,
                )
            fetched.get(weights)
    except HubError:
        raise
    except Stop as stop:
        raise stopped(str(stop), repo_id, revision, settings) from None
    except Exception as exc:
        raise typed(exc, repo_id, revision, settings) from exc
    lacking = fileset.missing(kind, folder)
    if lacking:
        raise HubNotFoundError(
            f"commit {commit} lacks {', '.join(lacking)}, which a {kind} needs", repo_id=repo_id, revision=revision
        )
    hub_cache.write_ref(settings.cache_dir, repo_id, revision, commit)
    return folder, commit


class _Fetched:
    """Downloads files of one commit into its snapshot, checking their listed sizes against the budget first."""

    def __init__(self, repo_id, revision, commit, sizes, settings: HubSettings, budget: Budget) -> None:
        self.repo_id, self.revision, self.commit, self.sizes = repo_id, revision, commit, sizes
        self.settings, self.budget = settings, budget
        self.planned = 0
        self.folder = hub_cache.snapshot(settings.cache_dir, repo_id, commit)

    def get(self, names: list[str]) -> None:
        from huggingface_hub import hf_hub_download

        todo = [n for n in names if not (self.folder / n).is_file()]
        self.planned += sum(self.sizes.get(n, 0) for n in todo)
        if self.planned > self.settings.max_bytes:
            raise HubTooLargeError(
                f"commit {self.commit} needs {self.planned} bytes downloaded, more than the limit of "
                f"{self.settings.max_bytes}; raise max_download_bytes (max_lora_download_bytes for adapters) if that "
                "is expected",
                repo_id=self.repo_id,
                revision=self.revision,
            )
        charged = self.budget.progress_class()
        for name in todo:
            hf_hub_download(
                self.repo_id,
                name,
                revision=self.commit,
                cache_dir=self.settings.cache_dir,
                endpoint=self.settings.endpoint,
                token=self.settings.token,
                etag_timeout=min(_METADATA_TIMEOUT, self.budget.remaining()),
                tqdm_class=charged,
            )


def _size(sibling) -> int:
    lfs = getattr(sibling, "lfs", None)
    size = getattr(lfs, "size", None) if lfs is not None else None
    size = size if size is not None else getattr(sibling, "size", None)
    return int(size or 0)


def _check_listing(kind: str, sizes: dict[str, int], repo_id: str, revision: str, commit: str) -> None:
    """The files a kind cannot do without are in the commit's listing (before anything is downloaded)."""
    if kind == fileset.ADAPTER:
        needed = [n for n in fileset.ADAPTER_FILES if n not in sizes]
        if "adapter_model.safetensors" in needed and "adapter_model.bin" in sizes:
            hint = "; it holds only adapter_model.bin (pickle), which is never loaded: save it with safetensors"
        else:
            hint = "; is it a PEFT LoRA adapter repo?"
    elif kind == fileset.MODEL:
        needed = [fileset.MODEL_CONFIG] if fileset.MODEL_CONFIG not in sizes else []
        hint = "; is it a transformers model repo?"
    else:
        needed = [] if any(n in sizes for n in fileset.TOKENIZER_FILES) else [fileset.TOKENIZER_FILES[0]]
        hint = "; does the repo hold a tokenizer?"
    if needed:
        raise HubNotFoundError(f"commit {commit} has no {', '.join(needed)}{hint}", repo_id=repo_id, revision=revision)
