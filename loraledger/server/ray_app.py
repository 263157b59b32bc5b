"""The Ray Serve application: `serve run examples/ray_serve.yaml`, whose import path is
`loraledger.server.ray_app:app_builder`. A Router deployment (the HTTP entry, ray_router.py) in front of the
EngineReplica deployment (one engine per replica, ray_replica.py); the application's `args` are RayServeArgs
(ray_config.py), Ray's part of the file (num_replicas, autoscaling_config, ray_actor_options) configures the two
deployments by name.

Importing this module imports Ray (the `ray` extra); the engine and `loraledger serve` never do.
"""

from ray import serve

from loraledger.server.ray_config import RayServeArgs
from loraledger.server.ray_replica import EngineReplica
from loraledger.server.ray_router import Router

__all__ = ["EngineReplica", "Router", "app_builder"]


def app_builder(args: dict) -> serve.Application:
    """The application `serve run` builds from the config file's `args` (RayServeArgs); Ray's part of the file
    (num_replicas, autoscaling_config, ray_actor_options) configures the two deployments by name."""
    parsed = RayServeArgs.parse(args)
    return Router.bind(EngineReplica.bind(parsed), parsed)
