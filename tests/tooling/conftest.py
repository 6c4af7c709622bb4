"""Fixtures for the tooling tests.

- `upstream`: a small synthetic upstream release and a series on top of it
  (fetch, apply, refresh);
- `series`, `tree`, `upstream_like_wheel`, `make_env`, `git_identity`: the
  real series built in a throwaway tree (scratch_tree borrows the cache's
  objects, so vllm/ and .work/, which `make test` runs against, are never
  touched), an upstream-like wheel and fresh venvs (wheel, overlay, export,
  import).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from keep.apply import scratch_tree
from lib.paths import DEFAULT_SERIES
from lib.series import Base, Series
from shipenv import Env, build_upstream_like_wheel

UPSTREAM_FILES = {
    "setup.py": "print('setup')\n",
    "vllm/__init__.py": "",
    "vllm/v1/core/block_pool.py": "".join(f"line {i}\n" for i in range(1, 41)),
    "vllm/v1/core/kv_cache_utils.py": "def popleft_n(n):\n    assert n\n",
    "tests/v1/core/test_block_pool.py": "def test_nothing():\n    pass\n",
    "vllm.egg-info/PKG-INFO": "generated\n",
    "PKG-INFO": "Name: vllm\n",
}


def make_sdist(dest: Path, version: str, files: dict[str, str]) -> Path:
    """A tarball shaped like upstream's sdist: one top folder vllm-<version>.
    Byte-stable (fixed mtimes, gzip header included): same files, same sha256."""
    path = dest / f"vllm-{version}.tar.gz"
    with (
        open(path, "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, text=True, capture_output=True
    ).stdout.strip()


@dataclass
class Upstream:
    series: Series
    cache: Path
    tree: Path
    sdist: Path

    def commit_in_tree(self, path: str, text: str, message: str) -> None:
        file = self.tree / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
        git(self.tree, "add", path)
        git(self.tree, "commit", "-q", "-m", message)

    def add_patch(self, path: str, text: str, message: str) -> None:
        """Make a patch the way a developer does: commit in the tree, refresh."""
        from keep.apply import apply_series
        from keep.refresh import refresh_series

        apply_series(self.series, self.tree, self.cache)
        self.commit_in_tree(path, text, message)
        refresh_series(self.series, self.tree)
        apply_series(self.series, self.tree, self.cache)

    def release(self, version: str, changes: dict[str, str | None]) -> Base:
        """Another upstream release: this one's files with `changes` (None
        removes a file), as an sdist next to the first."""
        files = {**UPSTREAM_FILES, **changes}
        files = {k: v for k, v in files.items() if v is not None}
        sdist = make_sdist(self.sdist.parent, version, files)
        return Base(
            version=version, sdist_url=sdist.as_uri(), sdist_sha256=sha256(sdist)
        )


@pytest.fixture
def upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Upstream:
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Test User")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "user@example.com")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "Test User")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "user@example.com")
    sdist = make_sdist(tmp_path, "9.9.9", UPSTREAM_FILES)
    series_dir = tmp_path / "patches"
    series_dir.mkdir()
    overlay = tmp_path / "overlay"
    (overlay / "vllm").mkdir(parents=True)
    (overlay / "vllm" / "_fork.py").write_text("FORK = 'test'\n")
    base = Base(version="9.9.9", sdist_url=sdist.as_uri(), sdist_sha256=sha256(sdist))
    (series_dir / "base.toml").write_text(base.to_toml())
    return Upstream(
        Series(series_dir, overlay=overlay),
        tmp_path / "cache",
        tmp_path / "vllm",
        sdist,
    )


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


# A series of five patches on 9.9.9 and a release 9.9.10 that:
# - leaves the code of patch 1 alone                     -> clean
# - changes a line two lines from patch 2's change        -> merged (3-way)
# - fixes patch 3's bug with other code than the patch    -> upstream (reproducer)
# - ships the file patch 4 adds, identical                -> upstream (change there)
# - changes the very line patch 5 changes                 -> conflict
LINES = "".join(f"line {i}\n" for i in range(1, 41))
REPRODUCER = "tests/reproducers/test_popleft.py::test_empty_pop_is_a_value_error"
NEW_RELEASE = {
    "vllm/v1/core/block_pool.py": LINES.replace("line 27\n", "line 27 (new)\n")
    .replace("line 20\n", "line XX\n")
    .replace("line 2\n", "line 2\nline 2.5\n"),
    # Fixed upstream, but not as patch 3 does it.
    "vllm/v1/core/kv_cache_utils.py": (
        "def popleft_n(n):\n"
        "    if n < 1:\n"
        "        raise ValueError('nothing to pop')\n"
        "    return n\n"
    ),
    "vllm/v1/core/new.py": "x = 1\n",
}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """Where the reproducers live (the project root, for the test ids)."""
    root = tmp_path / "project"
    (root / "tests" / "reproducers").mkdir(parents=True)
    (root / "tests" / "reproducers" / "test_popleft.py").write_text(
        "import pytest\n"
        "from vllm.v1.core.kv_cache_utils import popleft_n\n\n\n"
        "def test_empty_pop_is_a_value_error():\n"
        "    with pytest.raises(ValueError):\n"
        "        popleft_n(0)\n"
    )
    return root


@pytest.fixture
def five(upstream: Upstream) -> Upstream:
    """The series of five patches on 9.9.9."""
    up = upstream
    up.add_patch(
        "vllm/v1/core/block_pool.py",
        LINES.replace("line 35\n", "line thirty-five\n"),
        "Clean: change line 35",
    )
    text = (up.tree / "vllm/v1/core/block_pool.py").read_text()
    up.add_patch(
        "vllm/v1/core/block_pool.py",
        text.replace("line 29\n", "line twenty-nine\n"),
        "Merged: change line 29",
    )
    up.add_patch(
        "vllm/v1/core/kv_cache_utils.py",
        "def popleft_n(n):\n    if not n:\n        raise ValueError(n)\n",
        f"Fix: popleft_n raises ValueError\n\nReproducer: {REPRODUCER}",
    )
    up.add_patch("vllm/v1/core/new.py", "x = 1\n", "Add new.py")
    text = (up.tree / "vllm/v1/core/block_pool.py").read_text()
    up.add_patch(
        "vllm/v1/core/block_pool.py",
        text.replace("line 20\n", "line twenty\n"),
        "Conflict: change line 20",
    )
    return up
