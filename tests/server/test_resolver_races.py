"""Races around adapters loaded on first use (serving_models + lora_resolvers), driven directly with a stand-in
engine whose add_lora waits until the test lets it finish: what a request naming an adapter sees while an admin
loads or unloads it."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from loraledger.server.auth import ANONYMOUS
from loraledger.server.error_responses import APIError
from loraledger.server.lora_resolvers import LoRAResolverSpec
from loraledger.server.serving_models import OpenAIServingModels


class _Engine:
    """add_lora waits for `release` (a load under way); remove_lora forgets the id."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.started = anyio.Event()
        self.loaded: dict[int, str] = {}

    async def add_lora(self, lora) -> None:
        self.started.set()
        await self.release.wait()
        self.loaded[lora.lora_int_id] = lora.lora_path

    async def remove_lora(self, int_id: int) -> None:
        self.loaded.pop(int_id, None)


def _models(tmp_path, engine) -> OpenAIServingModels:
    folder = tmp_path / "adapters"
    (folder / "sql").mkdir(parents=True)
    (folder / "sql" / "adapter_config.json").write_text("{}")
    config = SimpleNamespace(
        served_model_name=("base",),
        engine_args=SimpleNamespace(model=str(tmp_path / "model")),
        lora_resolvers=(LoRAResolverSpec.parse(str(folder)),),
        lora_resolver_max_loras=4,
    )
    return OpenAIServingModels(SimpleNamespace(config=config, engine=engine))


@pytest.mark.anyio
async def test_a_request_naming_an_adapter_an_admin_is_loading_gets_that_adapter(tmp_path):
    # an admin's /v1/load_lora_adapter of a name a resolver also has is under way when a request names it: the
    # request is served on the adapter once the load ends (not a 400 "already loaded" about a field it never sent)
    engine = _Engine()
    models = _models(tmp_path, engine)
    got: dict[str, object] = {}

    async def admin() -> None:
        got["admin"] = await models.load("sql", str(tmp_path / "elsewhere"))

    async def request() -> None:
        try:
            got["request"] = await models.resolve("sql", ANONYMOUS, "/v1/completions")
        except APIError as exc:
            got["request"] = exc

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(admin)
            await engine.started.wait()
            tg.start_soon(request)
            await anyio.sleep(0.2)  # the request is waiting on the admin's load
            engine.release.set()
    assert not isinstance(got["request"], APIError), got["request"]
    assert got["request"] is got["admin"]
    assert models.resolvers.count(0) == 0  # the admin's load is not the resolver's: it took no place there


def test_a_relative_resolver_folder_gives_paths_that_never_read_as_hub_ids(tmp_path, monkeypatch):
    # `--lora-resolver adapters` (relative): the path a name resolves to must name that folder wherever it is read
    # (another working directory, the folder gone by the time the loader reads it), never the Hub repo
    # `adapters/NAME`, which anyone can publish
    from loraledger.sources import parse_pinned

    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    (tmp_path / "adapters" / "sql" / "adapter_config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    path = LoRAResolverSpec.parse("adapters").path_for("sql")
    assert path == str(tmp_path / "adapters" / "sql")
    assert parse_pinned(path) is None


def test_a_hub_resolver_takes_plain_revisions_only():
    # the revision in `NAME@rev` comes from any caller whose key may use the name: it must stay a branch, tag or
    # commit of the repo, not a path (`../..` reaches the Hub cache's files) nor a pull-request ref (refs/pr/N, which
    # anyone may push to on a public repo: unreviewed weights served under the organisation's name)
    hub = LoRAResolverSpec.parse("hf://acme")
    for name in ("sql@v1", "sql@main", "sql@release-2.0", "sql@" + "ab" * 20):
        assert hub.path_for(name) == f"acme/{name}", name
    for name in ("sql@refs/pr/1", "sql@../../x", "sql@..", "sql@a/../../b", "sql@.hidden", "sql@a%2Fb"):
        assert hub.path_for(name) is None, name


def test_a_local_folder_never_stands_in_for_a_hub_adapter(tmp_path, monkeypatch):
    # the loader reads a local path first: a folder acme/sql in the server's working directory would be served as
    # the Hub's acme/sql, so the Hub resolver names no such adapter (the next resolver, or 404)
    monkeypatch.chdir(tmp_path)
    hub = LoRAResolverSpec.parse("hf://acme")
    assert hub.path_for("sql") == "acme/sql" and hub.path_for("sql@v1") == "acme/sql@v1"
    (tmp_path / "acme" / "sql").mkdir(parents=True)
    assert hub.path_for("sql") is None and hub.path_for("sql@v1") is None
    assert hub.path_for("chat") == "acme/chat"


def test_a_revision_never_leads_out_of_the_hub_cache(tmp_path):
    # a revision is a ref file's name under refs/: one that climbs out (`../../..`) neither reads a file elsewhere
    # as a commit nor writes one there
    from loraledger.sources import hub_cache

    cache = tmp_path / "cache"
    commit = "c" * 40
    hub_cache.snapshot(str(cache), "acme/sql", commit).mkdir(parents=True)
    (hub_cache.repo_folder(str(cache), "acme/sql") / "refs").mkdir()  # as any earlier fetch leaves it
    (tmp_path / "leak").write_text(commit)
    escaping = "../../../leak"
    assert (hub_cache.repo_folder(str(cache), "acme/sql") / "refs" / escaping).resolve() == tmp_path / "leak"
    assert hub_cache.cached_commit(str(cache), "acme/sql", escaping) is None
    hub_cache.write_ref(str(cache), "acme/sql", "../../../written", commit)
    assert not (tmp_path / "written").exists()
    hub_cache.write_ref(str(cache), "acme/sql", "release/v1", commit)  # a branch with a slash stays a ref
    assert hub_cache.cached_commit(str(cache), "acme/sql", "release/v1") == commit


@pytest.mark.anyio
async def test_an_offline_hub_resolver_without_the_name_lets_the_next_resolver_serve_it(tmp_path):
    # HF_HUB_OFFLINE and a name not in the Hub cache: the Hub resolver does not have it, as a name not on the Hub;
    # a folder resolver after it that has the name serves it (it was a 400 hub_offline, the folder never tried)
    from loraledger.sources.hub_errors import HubOfflineError

    class _OfflineHub(_Engine):
        async def add_lora(self, lora) -> None:
            if not lora.lora_path.startswith("/"):
                raise HubOfflineError("HF_HUB_OFFLINE is set", repo_id=lora.lora_path, revision="main")
            self.loaded[lora.lora_int_id] = lora.lora_path

    engine = _OfflineHub()
    models = _models(tmp_path, engine)
    folder = models.resolvers.specs[0]
    models.resolvers.specs = (LoRAResolverSpec.parse("hf://acme"), folder)
    with anyio.fail_after(10):
        lora = await models.resolve("sql", ANONYMOUS, "/v1/completions")
    assert lora.lora_path == folder.path_for("sql")
    assert (models.resolvers.count(0), models.resolvers.count(1)) == (0, 1)
    with pytest.raises(APIError) as caught:
        await models.resolve("nowhere", ANONYMOUS, "/v1/completions")
    assert (caught.value.status, caught.value.code) == (404, "model_not_found")
