"""Wrapping engine functions in the benchmark's own process (profiler labels, timers), leaving the engine's code as it is."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable


def wrap(module_name: str, path: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace `module_name`'s `path` ("Class.method", or a module-level "function") by make_wrapper(original).

    The wrapper keeps the original's name and docstring (functools.wraps), so tracebacks still read well.
    """
    module = importlib.import_module(module_name)
    owner_name, _, attr = path.rpartition(".")
    owner = getattr(module, owner_name) if owner_name else module
    original = getattr(owner, attr)
    setattr(owner, attr, functools.wraps(original)(make_wrapper(original)))
