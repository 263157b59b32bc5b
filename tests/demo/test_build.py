"""loraledger.demo.build: one build of the cache folder at a time, and a recipe's digest follows what it trains on."""

from __future__ import annotations

import fcntl
from dataclasses import replace

import pytest

from loraledger.demo.build import ADAPTERS, build_lock, recipe_digest
from loraledger.errors import DemoFetchError


def test_a_build_waits_for_another_and_gives_up_at_its_deadline(tmp_path):
    said: list[str] = []
    with build_lock(tmp_path, said.append):  # the first build holds it; it is free again afterwards
        pass
    with (tmp_path / ".lock").open("a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process's build, as flock sees it
        with pytest.raises(DemoFetchError, match="another loraledger demo has been building"):
            with build_lock(tmp_path, said.append, deadline_s=0.3):
                pass
        assert said == [f"waiting for another loraledger demo building {tmp_path} ..."]
    with build_lock(tmp_path, said.append, deadline_s=0.3):
        pass


def test_the_recipe_digest_changes_with_the_lines_and_the_settings():
    recipe = ADAPTERS[0]
    examples = recipe.examples()
    digest = recipe_digest(examples, recipe.spec)
    assert digest == recipe_digest(recipe.examples(), recipe.spec)
    assert digest != recipe_digest(examples[1:], recipe.spec)
    assert digest != recipe_digest(examples, replace(recipe.spec, steps=recipe.spec.steps + 1))
