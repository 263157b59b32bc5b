"""Source: where a model, tokenizer or adapter was read from, and resolve(), which turns a name into one.

A name is a local folder or a Hub repo id (`org/name`), optionally pinned as `org/name@revision`
(a branch, a tag or a commit sha). A folder that exists wins, as in vLLM. A repo id is fetched
into the Hub cache (hub_fetch.py) and read from the snapshot of the commit it resolved to; that
commit, never the branch name, is what the audit log records.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from loraledger.errors import ConfigError
from loraledger.sources import hub_cache, hub_fetch
from loraledger.sources.hub_settings import HubSettings

DEFAULT_REVISION = "main"
_REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_-])?"
_REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")
_REVISION = re.compile(r"[^\s\x00-\x1f\x7f]{1,255}")


class Source(msgspec.Struct, frozen=True, kw_only=True):
    """A resolved name: the folder that is read, and for a Hub repo the repo, the revision asked and the commit."""

    name: str  # as given (a path, `org/name` or `org/name@revision`)
    folder: str  # the local folder read
    repo_id: str | None = None  # None: a local folder that is not a Hub cache snapshot
    revision: str | None = None  # the revision asked for ("main" when none was); None for a local folder
    commit: str | None = None  # the 40-hex commit sha the files are from; None for a plain local folder

    @classmethod
    def local(cls, name: str) -> Source:
        """A local folder (a snapshot folder of a Hub cache names its repo and commit)."""
        folder = str(Path(name).expanduser())
        origin = hub_cache.snapshot_origin(Path(folder))
        if origin is None:
            return cls(name=name, folder=folder)
        return cls(name=name, folder=folder, repo_id=origin[0], commit=origin[1])


def parse_pinned(name: str) -> tuple[str, str | None] | None:
    """(repo id, pinned revision or None) when `name` reads as a Hub repo id, else None (a path)."""
    repo, at, revision = name.partition("@")
    if not _REPO_ID.fullmatch(repo) or "--" in repo or ".." in repo:
        return None
    if at and not _REVISION.fullmatch(revision):
        raise ConfigError(f"{name!r}: the revision after '@' must be a branch, tag or commit sha without spaces")
    return repo, (revision if at else None)


def resolve(
    name: str, *, revision: str | None = None, kind: str, settings: HubSettings, at_commit: str | None = None
) -> Source:
    """The Source of `name`: the folder when it exists, else the Hub repo it names (downloaded, or from the cache
    offline), else the name as a folder (its reader reports it missing). Blocks: call it off the event loop.

    revision: the revision to resolve a repo id at (EngineArgs.revision / tokenizer_revision); a revision pinned in
    the name (`org/name@rev`) must agree with it. at_commit: read that commit (the one an earlier load of the same
    name resolved to), still recording the revision asked for: a branch that moved does not change what is served."""
    if Path(name).expanduser().exists():
        return Source.local(name)
    parsed = parse_pinned(name)
    if parsed is None:
        return Source(name=name, folder=name)
    repo_id, pinned = parsed
    if pinned is not None and revision is not None and pinned != revision:
        raise ConfigError(f"{name!r} pins revision {pinned!r} but revision={revision!r} was given too; give one")
    asked = pinned or revision or DEFAULT_REVISION
    folder, commit = hub_fetch.fetch(repo_id, at_commit or asked, kind, settings)
    return Source(name=name, folder=str(folder), repo_id=repo_id, revision=asked, commit=commit)
