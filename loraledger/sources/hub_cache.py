"""The Hub cache as huggingface_hub lays it out: models--org--name/{refs/<revision>, snapshots/<commit>/<file>}.

A ref names the commit a branch or tag resolved to the last time it was fetched; this engine writes
one only once every file of that commit it needs is in the snapshot, so a ref never leads to a
half-downloaded snapshot.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

COMMIT = re.compile(r"[0-9a-f]{40}")


def repo_folder(cache_dir: str, repo_id: str) -> Path:
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def snapshot(cache_dir: str, repo_id: str, commit: str) -> Path:
    return repo_folder(cache_dir, repo_id) / "snapshots" / commit


def _ref(cache_dir: str, repo_id: str, revision: str) -> Path | None:
    """refs/<revision>, or None when the revision is no ref name (git's rules: no empty, "." or ".." part), so that
    no revision leads out of refs/."""
    parts = revision.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return None
    return repo_folder(cache_dir, repo_id) / "refs" / revision


def cached_commit(cache_dir: str, repo_id: str, revision: str) -> str | None:
    """The commit `revision` (a branch, a tag, or a commit sha) names in the cache; None when it names none there."""
    if COMMIT.fullmatch(revision):
        return revision if snapshot(cache_dir, repo_id, revision).is_dir() else None
    ref = _ref(cache_dir, repo_id, revision)
    if ref is None:
        return None
    try:
        commit = ref.read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        return None
    return commit if COMMIT.fullmatch(commit) else None


def write_ref(cache_dir: str, repo_id: str, revision: str, commit: str) -> None:
    """refs/<revision> = commit, replaced atomically (a reader sees the old commit or the new one)."""
    ref = None if COMMIT.fullmatch(revision) else _ref(cache_dir, repo_id, revision)
    if ref is None:
        return  # a commit needs no ref; a name that is no ref is never written (the next use fetches it again)
    ref.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=ref.parent, prefix=".ref-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(commit)
        os.replace(tmp, ref)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def snapshot_origin(folder: Path) -> tuple[str, str] | None:
    """(repo id, commit) when `folder` is a snapshot in a Hub cache (a path snapshot_download returned), else None."""
    try:
        folder = folder.resolve()
    except (OSError, RuntimeError):
        return None
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--") or not COMMIT.fullmatch(folder.name):
        return None
    org_name = repo.removeprefix("models--").split("--")
    return "/".join(org_name), folder.name
