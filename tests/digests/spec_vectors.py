"""The test vectors of DIGESTS.md: every fenced json block with a "vector" member, read from the file itself."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SPEC = Path(__file__).resolve().parents[2] / "DIGESTS.md"
KINDS = (
    "canonical_json",
    "floats",
    "stored_time",
    "event_chain",
    "binding_sha256",
    "completions_sha256",
    "prompt_sha256",
    "text_commitment",
    "registration_sha256",
    "adapter_fingerprint",
    "base_model_fingerprint",
    "report",
)


def vectors() -> dict[str, dict[str, Any]]:
    """kind -> vector; each kind exactly once."""
    found: dict[str, dict[str, Any]] = {}
    for block in re.findall(r"```json\n(.*?)\n```", SPEC.read_text(encoding="utf-8"), flags=re.DOTALL):
        vector = json.loads(block)
        kind = vector.pop("vector")
        assert kind not in found, f"DIGESTS.md has two {kind} vectors"
        found[kind] = vector
    assert sorted(found) == sorted(KINDS), f"DIGESTS.md's vectors are {sorted(found)}, expected {sorted(KINDS)}"
    return found
