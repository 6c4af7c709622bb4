"""`make export` checks its arguments and the upstream clone before it
downloads or builds anything, and says how to export offline."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from conftest import git

from lib.errors import ForkError
from lib.paths import ROOT
from lib.series import find_series
from ship.export_preflight import check_onto, check_patches, offline_command

NEWEST = find_series()[-1]
OFFLINE = offline_command(NEWEST)


def make_export(
    tmp_path: Path, *args: str
) -> tuple[subprocess.CompletedProcess, float]:
    """`make export` with an empty download cache and no .venv: anything it
    fetched or built would land there."""
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    env_args = [
        f"VLLM_FORK_CACHE={cache}",
        f"VLLM_FORK_VENV={tmp_path / 'venv'}",
    ]
    start = time.monotonic()
    done = subprocess.run(
        ["env", *env_args, "make", "-s", "-C", str(ROOT), "export", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    elapsed = time.monotonic() - start
    assert not any(cache.iterdir()), "export downloaded before failing"
    assert not (tmp_path / "venv").exists(), "export built .venv before failing"
    return done, elapsed


def test_a_missing_clone_fails_at_once_with_the_offline_command(tmp_path, git_identity):
    done, elapsed = make_export(tmp_path, f"ARGS=--upstream {tmp_path / 'no-clone'}")
    assert done.returncode != 0
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert "no such directory" in done.stderr
    assert OFFLINE in done.stderr
    assert "Nothing was downloaded or built" in done.stderr
    # Which series, and why: the newest, because pull requests go to main.
    version = NEWEST.base().version
    assert f"exporting the {version} series" in done.stderr
    assert "pull requests go to upstream main" in done.stderr


def test_a_directory_that_is_not_a_clone_is_refused(tmp_path, git_identity):
    (tmp_path / "plain").mkdir()
    done, elapsed = make_export(
        tmp_path, "VERSION=0.28.0", f"ARGS=--upstream {tmp_path / 'plain'}"
    )
    assert done.returncode != 0 and elapsed < 10
    assert "is not a git repository" in done.stderr
    assert "exporting the 0.28.0 series (patches/v0.28.0/), as asked" in done.stderr
    assert 'make export VERSION=0.28.0 ARGS="--onto upstream/v0.28.0"' in done.stderr


def test_an_unreachable_url_fails_fast(tmp_path, git_identity):
    done, elapsed = make_export(
        tmp_path, "ARGS=--upstream https://127.0.0.1:9/vllm.git --onto main"
    )
    assert done.returncode != 0 and elapsed < 30
    assert "cannot reach 'main'" in done.stderr
    assert OFFLINE in done.stderr


def test_a_clone_without_the_ref_is_refused(tmp_path):
    clone = tmp_path / "clone"
    clone.mkdir()
    git(clone, "init", "-q", "-b", "main")
    git(
        clone,
        "-c",
        "user.name=a",
        "-c",
        "user.email=a@b",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "x",
    )
    no_tree = tmp_path / "tree"
    check_onto(NEWEST, no_tree, "main", str(clone), builds=True)  # found
    with pytest.raises(ForkError, match="cannot find 'nosuch'.*no branch or tag"):
        check_onto(NEWEST, no_tree, "nosuch", str(clone), builds=True)
    # Offline onto the release: the build fetches it into the tree.
    check_onto(NEWEST, no_tree, NEWEST.base().tag, None, builds=True)


def test_an_unknown_patch_is_refused_with_the_series_patches():
    with pytest.raises(ForkError, match="no patch in .* starts with 9999"):
        check_patches(NEWEST, ["9999"])
    check_patches(NEWEST, ["0001"])


def test_the_default_series_tree_must_be_there_and_hold_the_release(tmp_path):
    default = find_series()[0]
    tag = default.base().tag
    tree = tmp_path / "vllm"
    with pytest.raises(ForkError, match="is not a git checkout.*make apply VERSION="):
        check_onto(default, tree, tag, None, builds=False)
    tree.mkdir()
    git(tree, "init", "-q")
    with pytest.raises(ForkError, match=f"has no {tag}: `make apply VERSION="):
        check_onto(default, tree, tag, None, builds=False)
