"""Root conftest: the shared fixture modules (tiny models and adapters; SQLite and PostgreSQL databases)."""

pytest_plugins = ["tests.model_fixtures", "tests.db_fixtures"]

import pytest


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """The engine runs on asyncio (trio works through anyio too, but one backend keeps the suite's time down)."""
    return "asyncio"
