"""The Ray Serve application's args (RayServeArgs) and adapters folder, the example config the README shows, and the
rule that the engine and `loraledger serve` never import Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loraledger.errors import ConfigError
from loraledger.server.ray_config import AdapterFolder, RayServeArgs

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ray_serve.yaml"
PG = "postgresql+psycopg://loraledger@db/audit"


def test_the_engine_and_the_single_process_server_never_import_ray():
    modules = ["loraledger", "loraledger.server", "loraledger.server.app", "loraledger.server.serve_cli", "loraledger.cli",
               "loraledger.server.ray_config", "loraledger.server.asgi_relay"]  # fmt: skip
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def example_app() -> dict:
    config = yaml.safe_load(EXAMPLE.read_text())
    [app] = config["applications"]
    return app


def test_the_example_config_is_a_valid_serve_config_and_builds_the_application():
    pytest.importorskip("ray", reason="building the application needs Ray: pip install 'loraledger[ray]'")
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema(**yaml.safe_load(EXAMPLE.read_text()))  # Ray's own check of the file
    app = example_app()
    module, _, builder = app["import_path"].partition(":")
    ray_app = __import__(module, fromlist=[builder])
    assert isinstance(getattr(ray_app, builder)(app["args"]), serve.Application)
    assert {d["name"] for d in app["deployments"]} == {ray_app.EngineReplica.name, ray_app.Router.name}
    args = RayServeArgs.parse(app["args"])
    assert args.adapters_per_replica == app["args"]["engine"]["max_cpu_loras"]  # Ray's max_num_models_per_replica
    assert args.engine_args().max_loras == 4 and args.server_config().api_keys_file == "/etc/loraledger/keys.toml"


def test_the_readme_shows_the_example_config_as_it_is():
    readme = (REPO / "README.md").read_text()
    assert f"```yaml\n{EXAMPLE.read_text()}```" in readme
    assert "serve run examples/ray_serve.yaml" in readme


@pytest.mark.parametrize(
    "change, message",
    [
        ({"audit_url": "sqlite:///audit.db"}, "must be PostgreSQL"),
        ({"api_keys_file": None}, "no api_keys_file"),
        ({"adapter_dir": "/a"}, "unknown field `adapter_dir`"),
        ({"engine": {"max_lora": 2}}, "did you mean 'max_loras'"),
        ({"engine": {"max_loras": 4, "max_cpu_loras": 2}}, "max_cpu_loras"),
        ({"engine": {"model": "/other"}}, "not under engine"),
        ({"served_model_name": "llama"}, "served_model_name"),
        ({"engine": {"max_loras": "4"}}, "max_loras must be an integer"),
        ({"adapters_dir": "/a", "engine": {"enable_lora": False}}, "needs an engine with enable_lora"),
    ],
)
def test_bad_args_are_refused_before_any_replica_starts(change, message):
    args = {"model": "/models/m", "audit_url": PG, "api_keys_file": "/keys.toml", **change}
    with pytest.raises(ConfigError, match=message):
        RayServeArgs.parse({k: v for k, v in args.items() if v is not None})


def test_without_keys_only_an_explicit_choice_serves():
    args = RayServeArgs.parse({"model": "/models/m", "audit_url": PG, "insecure_no_auth": True})
    assert args.server_config().api_keys_file is None


def test_the_adapters_folder_names_only_its_own_adapter_folders(tmp_path):
    for name in ("sql", "not_an_adapter"):
        (tmp_path / name).mkdir()
    (tmp_path / "sql" / "adapter_config.json").write_text("{}")
    folder = AdapterFolder(str(tmp_path))
    assert folder.path("sql") == tmp_path / "sql"
    for name in ("not_an_adapter", "missing", "..", ".", "", "../sql", "sql/../sql", ".hidden"):
        assert folder.path(name) is None, name
    assert AdapterFolder(None).path("sql") is None
