"""Where loraledger writes files of its own: a cache (model fingerprints, the demo model) and data (the default audit database).

`$LORALEDGER_HOME`, when set, is the one root of both: `$LORALEDGER_HOME/cache` and
`$LORALEDGER_HOME/data` (the test suite points it at a temporary folder, so no test writes into
the user's home). Otherwise they are the platform's user cache and data folders (platformdirs:
`~/.cache/loraledger` and `~/.local/share/loraledger` on Linux).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

HOME_ENV = "LORALEDGER_HOME"
APP = "loraledger"


def _home() -> Path | None:
    root = os.environ.get(HOME_ENV)
    return Path(root).expanduser() if root else None


def cache_dir() -> Path:
    """Files that can be rebuilt: the model-fingerprint cache, the demo's model and adapters."""
    home = _home()
    return home / "cache" if home is not None else Path(platformdirs.user_cache_dir(APP))


def data_dir() -> Path:
    """Files that are kept: the default audit database."""
    home = _home()
    return home / "data" if home is not None else Path(platformdirs.user_data_dir(APP))


def default_audit_url() -> str:
    """The engine's default audit database: a SQLite file in data_dir()."""
    return f"sqlite:///{data_dir() / 'audit.sqlite3'}"
