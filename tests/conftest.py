"""Root conftest: the shared fixture modules (tiny models and adapters; SQLite and PostgreSQL databases)."""

pytest_plugins = ["tests.model_fixtures", "tests.db_fixtures"]
