"""Shared test setup.

tests/ is not a package: vLLM's own `tests` package is importable when a
tree is on PYTHONPATH, and the names must not collide. Instead the harness
and the tooling's modules are put on sys.path here.
"""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "scripts")]


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only when asked for: -m slow (make test-slow)."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run by make test-slow (pytest -m slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
