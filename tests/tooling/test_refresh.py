"""refresh: writes the series back from the tree, byte-stable."""

from __future__ import annotations

import pytest
from conftest import Upstream, git

from keep.apply import apply_series
from keep.refresh import refresh_series
from lib.errors import ForkError


def snapshot(up: Upstream) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(up.series.dir.iterdir())}


def test_round_trip_is_byte_identical(upstream: Upstream):
    apply_series(upstream.series, upstream.tree, upstream.cache)
    upstream.commit_in_tree("vllm/v1/core/a.py", "a = 1\n", "[Core] Add a")
    upstream.commit_in_tree(
        "vllm/v1/core/b.py",
        "b = 2\n",
        "[Core] Add b\n\nWhy b.\n\nReproducer: tests/reproducers/test_b.py::test_b",
    )
    refresh_series(upstream.series, upstream.tree)
    first = snapshot(upstream)
    assert sorted(first) == [
        "0001-Core-Add-a.patch",
        "0002-Core-Add-b.patch",
        "base.toml",
    ]
    # Rebuild from the patches and write them back: not one byte changes.
    upstream.series.overlay.joinpath("vllm/_fork.py").write_text("FORK = 'v2'\n")
    assert apply_series(upstream.series, upstream.tree, upstream.cache)
    changes = refresh_series(upstream.series, upstream.tree)
    assert changes == {"added": [], "updated": [], "removed": []}
    assert snapshot(upstream) == first
    assert upstream.series.patches()[1].reproducers() == [
        "tests/reproducers/test_b.py::test_b"
    ]


def test_edit_add_and_drop_patches(upstream: Upstream):
    apply_series(upstream.series, upstream.tree, upstream.cache)
    upstream.commit_in_tree("vllm/v1/core/a.py", "a = 1\n", "Add a")
    refresh_series(upstream.series, upstream.tree)
    apply_series(upstream.series, upstream.tree, upstream.cache)
    # Amend the patch commit (below the overlay commit) and add another one.
    git(upstream.tree, "reset", "-q", "--hard", "HEAD~1")
    (upstream.tree / "vllm/v1/core/a.py").write_text("a = 2\n")
    git(upstream.tree, "commit", "-q", "-a", "--amend", "--no-edit")
    upstream.commit_in_tree("vllm/v1/core/c.py", "c = 3\n", "Add c")
    changes = refresh_series(upstream.series, upstream.tree)
    assert changes == {
        "added": ["0002-Add-c.patch"],
        "updated": ["0001-Add-a.patch"],
        "removed": [],
    }
    git(upstream.tree, "reset", "-q", "--hard", "HEAD~1")
    changes = refresh_series(upstream.series, upstream.tree)
    assert changes["removed"] == ["0002-Add-c.patch"]


def test_changes_to_overlay_files_belong_in_overlay(upstream: Upstream):
    apply_series(upstream.series, upstream.tree, upstream.cache)
    upstream.commit_in_tree("vllm/_fork.py", "FORK = 'edited'\n", "Edit overlay file")
    with pytest.raises(ForkError, match="overlay owns: vllm/_fork.py"):
        refresh_series(upstream.series, upstream.tree)


def test_refresh_refuses_uncommitted_work(upstream: Upstream):
    apply_series(upstream.series, upstream.tree, upstream.cache)
    (upstream.tree / "vllm/v1/core/kv_cache_utils.py").write_text("wip\n")
    with pytest.raises(ForkError, match="uncommitted changes"):
        refresh_series(upstream.series, upstream.tree)
    assert (upstream.tree / "vllm/v1/core/kv_cache_utils.py").read_text() == "wip\n"
