"""Loads the compiled extension on first use, with an actionable message when it is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

_core: ModuleType | None = None


def core() -> ModuleType:
    """Return ``pdgate._core``, importing it the first time."""
    global _core
    if _core is None:
        try:
            _core = importlib.import_module("pdgate._core")
        except ImportError as exc:
            raise ImportError(
                "pdgate's compiled gateway (pdgate._core) is not built; install the package "
                "with `pip install .` or run `maturin develop --release` in the repository"
            ) from exc
    return _core
