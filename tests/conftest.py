"""Root conftest: the shared fixture modules (tiny models and adapters; SQLite and PostgreSQL databases)."""

import torch

pytest_plugins = ["tests.model_fixtures", "tests.db_fixtures"]

# the test models are tiny: one intra-op thread is as fast, and keeps timings steady when the
# machine is busy (two threads fighting a loaded second core made steps 10-40x slower)
torch.set_num_threads(1)

import pytest


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """The engine runs on asyncio (trio works through anyio too, but one backend keeps the suite's time down)."""
    return "asyncio"
