"""Root conftest: the shared fixture modules (tiny models and adapters; SQLite and PostgreSQL databases),
and one loraledger home under tmp for the whole run, so no test writes into the user's home."""

import os
import tempfile

# Before anything imports the package: every cache, data folder and default audit database of the
# run lives under this folder ($LORALEDGER_HOME, see loraledger.paths), subprocesses included.
os.environ["LORALEDGER_HOME"] = tempfile.mkdtemp(prefix="loraledger-test-home-")
os.environ.pop("LORALEDGER_AUDIT_URL", None)  # a developer's own audit database is never a test's default
# no test reaches the real Hub: a repo id resolves against a port nothing listens on (tests/fake_hub.py serves one)
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ["HF_HOME"] = os.path.join(os.environ["LORALEDGER_HOME"], "hf-home")
# dtype="auto" on the CPU stays fp32 (exact against transformers' fp32) in every test, subprocesses included; the
# bf16 choice on CPUs that multiply bf16 natively is tested on its own (tests/gpu/test_cpu_bf16.py)
os.environ["LORALEDGER_CPU_NATIVE_BF16"] = "0"

import shutil

import pytest
import torch

pytest_plugins = ["tests.model_fixtures", "tests.db_fixtures", "tests.fake_hub"]

# the test models are tiny: one intra-op thread is as fast, and keeps timings steady when the
# machine is busy (two threads fighting a loaded second core made steps 10-40x slower)
torch.set_num_threads(1)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ["LORALEDGER_HOME"], ignore_errors=True)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """The engine runs on asyncio (trio works through anyio too, but one backend keeps the suite's time down)."""
    return "asyncio"
