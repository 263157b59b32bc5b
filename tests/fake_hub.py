"""A Hugging Face Hub on 127.0.0.1 for tests: the routes huggingface_hub calls to resolve and download a repo.

`FakeHub.push(repo_id, files, branch="main")` makes a commit (a new 40-hex sha) of `files` (name ->
bytes, or a folder whose top-level files are read) and moves the branch to it. Routes:
GET /api/models/{repo}[/revision/{rev}] (model info with the commit sha and the file listing, sizes
included) and HEAD/GET /{repo}/resolve/{rev}/{file} (X-Repo-Commit, ETag, the bytes). A repo may be
private (`token=`: other callers get 401 as the Hub answers them), gated (401 GatedRepo), or hung
(`hang=True`: downloads stall until the test ends), or list every file as 1 byte (`understate=True`). `requests` counts what was asked, by kind.

Fixture `fake_hub` (function scope): a running FakeHub with HF_ENDPOINT pointed at it, HF_HOME and
HF_HUB_CACHE under tmp, HF_HUB_OFFLINE and HF_TOKEN unset.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None
    gated: bool = False
    hang: bool = False
    understate: bool = False  # the listing gives every file as 1 byte (a Hub that lies about sizes)
    order: int = 0


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: Counter[str] = Counter()
        self.released = threading.Event()  # set at teardown: hung downloads end
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.released.set()
        self._server.shutdown()
        self._server.server_close()

    def push(self, repo_id: str, files: dict[str, bytes] | Path, branch: str = "main", **flags) -> str:
        """A new commit of `files` on `branch`; returns its sha. flags: token, gated, hang (set on the repo)."""
        if isinstance(files, Path):
            files = {p.name: p.read_bytes() for p in sorted(files.iterdir()) if p.is_file()}
        repo = self.repos.setdefault(repo_id, FakeRepo())
        for name, value in flags.items():
            setattr(repo, name, value)
        repo.order += 1
        sha = hashlib.sha1(f"{repo_id}:{repo.order}:{sorted(files)}".encode()).hexdigest()
        repo.commits[sha] = dict(files)
        repo.refs[branch] = sha
        return sha

    def resolve(self, repo: FakeRepo, revision: str) -> str | None:
        if revision in repo.commits:
            return revision
        return repo.refs.get(revision)


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        def _route(self, *, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo_id = "/".join(parts[2:4])
                revision = "/".join(parts[5:]) if len(parts) > 5 and parts[4] == "revision" else "main"
                hub.requests["info"] += 1
                self._info(repo_id, revision)
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo_id = "/".join(parts[:2])
                hub.requests["head" if head else "get"] += 1
                self._file(repo_id, parts[3], "/".join(parts[4:]), head)
            else:
                self._error(404, "EntryNotFound", "no such route")

        def _repo(self, repo_id: str) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                return None
            if repo.gated:
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
                return None
            if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._error(401, "RepoNotFound", "Invalid credentials in Authorization header")
                return None
            return repo

        def _info(self, repo_id: str, revision: str) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            sha = hub.resolve(repo, revision)
            if sha is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return
            siblings = [
                {
                    "rfilename": name,
                    "size": 1 if repo.understate else len(data),
                    "blobId": hashlib.sha1(data).hexdigest(),
                }
                for name, data in sorted(repo.commits[sha].items())
            ]
            body = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.token is not None,
                    "siblings": siblings, "tags": [], "downloads": 0, "likes": 0}  # fmt: skip
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head=False)

        def _file(self, repo_id: str, revision: str, name: str, head: bool) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            sha = hub.resolve(repo, revision)
            if sha is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return
            data = repo.commits[sha].get(name)
            if data is None:
                self._error(404, "EntryNotFound", f"{name} does not exist at {sha}")
                return
            headers = {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Content-Type": "application/octet-stream"}  # fmt: skip
            if repo.hang and not head:
                self.send_response(200)
                for key, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(key, value)
                self.end_headers()
                hub.released.wait(120)  # sends nothing until the test is over, then the bytes (a late answer)
                self.wfile.write(data)
                return
            self._send(200, data, headers, head=head)

        def _error(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self._send(status, body, {"X-Error-Code": code, "X-Error-Message": message,
                                      "Content-Type": "application/json"}, head=self.command == "HEAD")  # fmt: skip

        def _send(self, status: int, body: bytes, headers: dict[str, str], *, head: bool) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

    return Handler


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    hub = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    try:
        yield hub
    finally:
        hub.stop()
