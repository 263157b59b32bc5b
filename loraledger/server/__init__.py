"""The HTTP server (`loraledger serve`): OpenAI- and vLLM-compatible routes over one AsyncEngine, every caller
authenticated by an API key and on record. The engine never imports this package.

`build_app(config)` makes the FastAPI app (its lifespan starts and drains the engine); `api_router.router` holds
the routes, so another host (a Ray Serve deployment) can mount them on an app whose state it provides.
"""

from loraledger.server.app import build_app
from loraledger.server.server_config import LoRAModule, ServerConfig

__all__ = ["LoRAModule", "ServerConfig", "build_app"]
