"""loraledger.sources: a name resolved to a local folder or a Hub repo at a commit, against tests/fake_hub.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from loraledger.errors import ConfigError
from loraledger.sources import (
    HubAccessError,
    HubNotFoundError,
    HubOfflineError,
    HubSettings,
    HubTimeoutError,
    HubTooLargeError,
    parse_pinned,
    resolve,
)
from loraledger.sources.hub_cache import repo_folder


def settings(**overrides) -> HubSettings:
    return HubSettings.from_env(timeout=overrides.pop("timeout", 30.0), max_bytes=overrides.pop("max_bytes", 1 << 30))


def test_parse_pinned_tells_repo_ids_from_paths():
    assert parse_pinned("org/name") == ("org/name", None)
    assert parse_pinned("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_pinned("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for path in ("/abs/org/name", "./org/name", "a/b/c", "name", "org/../x", "org/na--me", "~/x"):
        assert parse_pinned(path) is None, path
    with pytest.raises(ConfigError, match="revision after '@'"):
        parse_pinned("org/name@has space")


def test_adapter_downloads_once_then_comes_from_the_cache(fake_hub, tiny_llama):
    sha = fake_hub.push("org/qv", tiny_llama.adapters["qv_r4"])
    first = resolve("org/qv", kind="adapter", settings=settings())
    assert (first.repo_id, first.revision, first.commit) == ("org/qv", "main", sha)
    assert sorted(p.name for p in Path(first.folder).iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (repo_folder(settings().cache_dir, "org/qv") / "refs" / "main").read_text() == sha
    gets = fake_hub.requests["get"]
    again = resolve("org/qv", kind="adapter", settings=settings())
    assert again == first
    assert fake_hub.requests["get"] == gets  # nothing downloaded twice


def test_a_new_commit_on_main_resolves_to_the_new_commit(fake_hub, tiny_llama):
    old = fake_hub.push("org/a", tiny_llama.adapters["qv_r4"])
    assert resolve("org/a", kind="adapter", settings=settings()).commit == old
    new = fake_hub.push("org/a", tiny_llama.adapters["all_r8"])
    assert resolve("org/a", kind="adapter", settings=settings()).commit == new


def test_pinned_revisions(fake_hub, tiny_llama):
    first = fake_hub.push("org/a", tiny_llama.adapters["qv_r4"])
    tagged = fake_hub.push("org/a", tiny_llama.adapters["all_r8"], branch="v2")
    fake_hub.push("org/a", tiny_llama.adapters["ogd_r16_rslora"])
    assert resolve(f"org/a@{first}", kind="adapter", settings=settings()).commit == first
    by_tag = resolve("org/a@v2", kind="adapter", settings=settings())
    assert (by_tag.revision, by_tag.commit) == ("v2", tagged)
    assert resolve("org/a", revision="v2", kind="adapter", settings=settings()).commit == tagged
    with pytest.raises(ConfigError, match="give one"):
        resolve("org/a@v2", revision="main", kind="adapter", settings=settings())


def test_offline_uses_the_cache_only(fake_hub, tiny_llama, monkeypatch):
    sha = fake_hub.push("org/a", tiny_llama.adapters["qv_r4"])
    online = resolve("org/a", kind="adapter", settings=settings())
    fake_hub.push("org/a", tiny_llama.adapters["all_r8"])  # main moves on the Hub; offline still sees the cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    asked = fake_hub.requests.total()
    offline = resolve("org/a", kind="adapter", settings=settings())
    assert offline == online and offline.commit == sha
    assert resolve(f"org/a@{sha}", kind="adapter", settings=settings()).commit == sha
    assert fake_hub.requests.total() == asked  # no request reached the Hub
    with pytest.raises(HubOfflineError, match="holds no snapshot"):
        resolve("org/never-fetched", kind="adapter", settings=settings())
    # a snapshot missing a file (a download cut short) is refused, never loaded
    (Path(online.folder) / "adapter_model.safetensors").unlink()
    with pytest.raises(HubOfflineError, match="lacks adapter_model.safetensors"):
        resolve("org/a", kind="adapter", settings=settings())


def test_not_found_unauthorized_and_gated(fake_hub, tiny_llama, monkeypatch):
    with pytest.raises(HubNotFoundError, match="no such repo"):
        resolve("org/missing", kind="adapter", settings=settings())
    fake_hub.push("org/a", tiny_llama.adapters["qv_r4"])
    with pytest.raises(HubNotFoundError, match="no such revision"):
        resolve("org/a@nope", kind="adapter", settings=settings())
    fake_hub.push("org/private", tiny_llama.adapters["qv_r4"], token="hf_secret")
    with pytest.raises(HubNotFoundError, match="HF_TOKEN"):
        resolve("org/private", kind="adapter", settings=settings())
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert resolve("org/private", kind="adapter", settings=settings()).repo_id == "org/private"
    fake_hub.push("org/gated", tiny_llama.adapters["qv_r4"], gated=True)
    with pytest.raises(HubAccessError, match="gated"):
        resolve("org/gated", kind="adapter", settings=settings())
    fake_hub.push("org/model-not-adapter", {"config.json": b"{}"})
    with pytest.raises(HubNotFoundError, match="adapter_config.json"):
        resolve("org/model-not-adapter", kind="adapter", settings=settings())


def test_size_limit_is_checked_before_downloading(fake_hub, tiny_llama):
    fake_hub.push("org/a", tiny_llama.adapters["all_r8"])
    with pytest.raises(HubTooLargeError, match="more than the limit"):
        resolve("org/a", kind="adapter", settings=settings(max_bytes=1000))
    assert fake_hub.requests["get"] == 0
    assert not (repo_folder(settings().cache_dir, "org/a") / "refs" / "main").exists()


def test_bytes_beyond_the_limit_stop_a_download_whatever_the_listing_said(fake_hub, tiny_llama):
    fake_hub.push("org/a", tiny_llama.adapters["all_r8"], understate=True)
    with pytest.raises(HubTooLargeError, match="sent more than the limit"):
        resolve("org/a", kind="adapter", settings=settings(max_bytes=4096))
    assert not (repo_folder(settings().cache_dir, "org/a") / "refs" / "main").exists()


def test_a_hung_download_hits_the_deadline(fake_hub, tiny_llama):
    fake_hub.push("org/slow", tiny_llama.adapters["qv_r4"], hang=True)
    started = time.monotonic()
    with pytest.raises(HubTimeoutError, match="deadline"):
        resolve("org/slow", kind="adapter", settings=settings(timeout=1.5))
    assert time.monotonic() - started < 5
    # the Hub answers late: the abandoned download stops at its first chunk and leaves no ref behind
    fake_hub.released.set()
    for thread in [t for t in threading.enumerate() if t.name == "hub-fetch"]:
        thread.join(30)
        assert not thread.is_alive()
    assert not (repo_folder(settings().cache_dir, "org/slow") / "refs" / "main").exists()


def test_a_local_folder_wins_and_a_snapshot_path_names_its_commit(fake_hub, tiny_llama, tmp_path, monkeypatch):
    sha = fake_hub.push("org/a", tiny_llama.adapters["qv_r4"])
    local = tmp_path / "org" / "a"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    got = resolve("org/a", kind="adapter", settings=settings())
    assert (got.folder, got.repo_id, got.commit) == ("org/a", None, None)
    assert fake_hub.requests.total() == 0
    monkeypatch.chdir(tmp_path / "org")
    snapshot = resolve("org/a", kind="adapter", settings=settings()).folder  # no ./org/a here: the Hub
    as_path = resolve(snapshot, kind="adapter", settings=settings())
    assert (as_path.folder, as_path.repo_id, as_path.revision, as_path.commit) == (snapshot, "org/a", None, sha)


def test_a_model_repo_brings_config_weights_and_tokenizer(fake_hub, tiny_llama):
    sha = fake_hub.push("org/tiny", tiny_llama.model_dir)
    got = resolve("org/tiny", kind="model", settings=settings())
    names = {p.name for p in Path(got.folder).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert got.commit == sha
