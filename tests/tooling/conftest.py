"""Fixtures for the shipping tools' tests: trees, wheels, fresh environments.

Trees are throwaway (scratch_tree borrows the cache's objects), so the
tests never touch vllm/ or .work/, which `make test` runs against.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apply import scratch_tree
from common import DEFAULT_SERIES
from series import Series
from shipenv import Env, build_upstream_like_wheel


@pytest.fixture(scope="session")
def series() -> Series:
    return Series(DEFAULT_SERIES)


@pytest.fixture(scope="session")
def tree(series: Series, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tree built from the series, ours alone."""
    return scratch_tree(series, tmp_path_factory.mktemp("tree") / "vllm")


@pytest.fixture(scope="session")
def upstream_like_wheel(
    series: Series, tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return build_upstream_like_wheel(tree, series, tmp_path_factory.mktemp("upstream"))


@pytest.fixture
def make_env(tmp_path: Path):
    """Makes fresh virtual environments under the test's tmp_path."""

    def make(name: str = "env") -> Env:
        return Env(tmp_path / name)

    return make


@pytest.fixture
def git_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A git configuration of our own, with a user identity."""
    config = tmp_path / "gitconfig"
    config.write_text("[user]\n\tname = Ada Tester\n\temail = ada@example.com\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    return "Ada Tester <ada@example.com>"
