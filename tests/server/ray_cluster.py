"""A local Ray instance for the tests (loopback, its files under one temporary folder, removed after) and the
loraledger Serve application on it; the replicas' pids, so a test can kill one."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from tests.server.live import free_port

REPO = Path(__file__).resolve().parents[2]
APP = "loraledger"


class RayServe:
    """`with RayServe(app_args, replicas=2) as cluster:` Ray started, the application deployed and answering at
    cluster.base_url; Serve and Ray stopped and their files removed on exit."""

    def __init__(self, args: dict, *, replicas: int, env: dict[str, str] | None = None) -> None:
        self.args, self.replicas = args, replicas
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # a short folder: Ray's unix sockets live under it, and their paths may not exceed 107 bytes
        self.tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.env = {
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
            ),  # this checkout's code
            "LORALEDGER_HOME": os.environ["LORALEDGER_HOME"],
            "OMP_NUM_THREADS": "1",
            "RAY_TMPDIR": self.tmp,
            "RAY_AUTH_MODE": "disabled",
            **(env or {}),
        }

    def __enter__(self) -> RayServe:
        import ray
        from ray import serve

        from loraledger.server.ray_app import EngineReplica, Router
        from loraledger.server.ray_config import RayServeArgs

        # Ray's token authentication would write a token into the home folder; this instance listens on loopback only
        self._saved = {name: os.environ.get(name) for name in ("RAY_TMPDIR", "RAY_AUTH_MODE")}
        os.environ.update(RAY_TMPDIR=self.tmp, RAY_AUTH_MODE="disabled")
        ray.init(
            num_cpus=8, include_dashboard=False, _temp_dir=self.tmp, namespace="loraledger-test", log_to_driver=False,
            runtime_env={"env_vars": self.env}, _node_ip_address="127.0.0.1",
        )  # fmt: skip
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": self.port}, detached=False)
            parsed = RayServeArgs.parse(self.args)
            replica = EngineReplica.options(num_replicas=self.replicas, ray_actor_options={"num_cpus": 1})
            serve.run(
                Router.options(ray_actor_options={"num_cpus": 0.5}).bind(replica.bind(parsed), parsed),
                name=APP,
                route_prefix="/",
            )
            self.wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.running_replicas() == self.replicas:
                try:
                    if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"the Serve application did not have {self.replicas} healthy replicas within {timeout} s")

    def running_replicas(self) -> int:
        from ray import serve

        app = serve.status().applications.get(APP)
        if app is None or "EngineReplica" not in app.deployments:
            return 0
        return app.deployments["EngineReplica"].replica_states.get("RUNNING", 0)

    def replica_pids(self) -> list[int]:
        """The pids of the engine replicas' processes."""
        import ray

        pids = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == "serve" and "EngineReplica" in entry["name"]:
                actor = ray.get_actor(entry["name"], namespace="serve")
                pids.append(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30))
        return pids

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            for name, value in self._saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            shutil.rmtree(self.tmp, ignore_errors=True)
