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

try:  # hypothesis budgets: small in `make test`, larger in `make soak`
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci", max_examples=40, stateful_step_count=30, deadline=None
    )
    settings.register_profile(
        "soak",
        max_examples=600,
        stateful_step_count=80,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    import os

    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # the tooling tests run without hypothesis too
    pass


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only when asked for: -m slow (make test-slow)."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run by make test-slow (pytest -m slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
