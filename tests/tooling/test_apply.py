"""apply: builds the tree, is idempotent, reports conflicts, keeps user work."""

from __future__ import annotations

import pytest
from conftest import UPSTREAM_FILES, Upstream, git, make_sdist, sha256

from keep.apply import apply_series, checkout_base
from keep.refresh import refresh_series
from lib.errors import ForkError
from lib.series import Base


def add_patch(up: Upstream, path: str, text: str, message: str) -> None:
    """Make a patch the way a developer does: commit in the tree, refresh."""
    apply_series(up.series, up.tree, up.cache)
    up.commit_in_tree(path, text, message)
    refresh_series(up.series, up.tree)
    apply_series(up.series, up.tree, up.cache)


def test_builds_base_patches_and_overlay(upstream: Upstream):
    add_patch(upstream, "vllm/v1/core/new.py", "x = 1\n", "Add new module")
    subjects = git(upstream.tree, "log", "--format=%s").splitlines()
    assert subjects == [
        "fork: overlay (1 files)",
        "Add new module",
        "Import upstream vLLM 9.9.9",
    ]
    assert git(upstream.tree, "rev-parse", "--abbrev-ref", "HEAD") == "fork/v9.9.9"
    assert (upstream.tree / "vllm" / "_fork.py").read_text() == "FORK = 'test'\n"
    # sdist build outputs are not part of the imported source
    assert not (upstream.tree / "PKG-INFO").exists()
    assert not (upstream.tree / "vllm.egg-info").exists()
    # setuptools-scm's `git describe` sees the release tag on the patched HEAD.
    assert git(upstream.tree, "describe", "--tags") == "v9.9.9"


def test_apply_again_does_nothing(upstream: Upstream):
    add_patch(upstream, "vllm/v1/core/new.py", "x = 1\n", "Add new module")
    head = git(upstream.tree, "rev-parse", "HEAD")
    assert apply_series(upstream.series, upstream.tree, upstream.cache) is False
    assert git(upstream.tree, "rev-parse", "HEAD") == head


def test_a_tree_with_the_old_base_tag_is_moved_to_the_new_layout(upstream: Upstream):
    apply_series(upstream.series, upstream.tree, upstream.cache)
    base = upstream.series.base()
    head = git(upstream.tree, "rev-parse", "HEAD")
    # Trees built before the base moved to refs/remotes/ had it as a tag.
    git(upstream.tree, "tag", base.tag, base.tree_ref)
    git(upstream.tree, "update-ref", "-d", base.tree_ref)
    assert apply_series(upstream.series, upstream.tree, upstream.cache) is True
    assert git(upstream.tree, "rev-parse", "HEAD") == head
    assert git(upstream.tree, "tag", "--list", base.tag) == ""
    assert git(upstream.tree, "rev-parse", base.tree_ref)
    refresh_series(upstream.series, upstream.tree)  # finds the base again


def test_same_inputs_give_the_same_commits(upstream: Upstream, tmp_path):
    add_patch(upstream, "vllm/v1/core/new.py", "x = 1\n", "Add new module")
    other = tmp_path / "other"
    apply_series(upstream.series, other, tmp_path / "other-cache")
    assert git(other, "rev-parse", "HEAD") == git(upstream.tree, "rev-parse", "HEAD")


def test_conflict_names_patch_files_and_next_steps(upstream: Upstream):
    add_patch(
        upstream,
        "vllm/v1/core/block_pool.py",
        "".join(f"line {i}\n" for i in range(1, 41)).replace(
            "line 20\n", "line twenty\n"
        ),
        "Rename line 20",
    )
    # The base changes under the patch: same line, different text.
    files = dict(UPSTREAM_FILES)
    files["vllm/v1/core/block_pool.py"] = files["vllm/v1/core/block_pool.py"].replace(
        "line 20\n", "line XX\n"
    )
    sdist = make_sdist(upstream.sdist.parent, "9.9.10", files)
    new_base = Base(
        version="9.9.10", sdist_url=sdist.as_uri(), sdist_sha256=sha256(sdist)
    )
    upstream.series.base_file.write_text(new_base.to_toml())
    with pytest.raises(ForkError) as info:
        apply_series(upstream.series, upstream.tree, upstream.cache)
    msg = str(info.value)
    assert "0001-Rename-line-20.patch (1 of 1)" in msg
    assert "vllm/v1/core/block_pool.py" in msg
    assert "am --continue" in msg and "make refresh" in msg and "am --abort" in msg
    # The tree is left mid-apply, resolvable, and a re-run refuses to touch it.
    assert "<<<<<<<" in (upstream.tree / "vllm/v1/core/block_pool.py").read_text()
    with pytest.raises(ForkError, match="middle of a git am"):
        apply_series(upstream.series, upstream.tree, upstream.cache)


def test_uncommitted_edits_are_refused_and_kept(upstream: Upstream):
    apply_series(upstream.series, upstream.tree, upstream.cache)
    edited = upstream.tree / "vllm/v1/core/kv_cache_utils.py"
    edited.write_text("my edit\n")
    (upstream.tree / "notes.txt").write_text("mine\n")
    upstream.series.overlay.joinpath("vllm/_fork.py").write_text("FORK = 'v2'\n")
    with pytest.raises(ForkError) as info:
        apply_series(upstream.series, upstream.tree, upstream.cache)
    assert "uncommitted changes" in str(info.value)
    assert "vllm/v1/core/kv_cache_utils.py" in str(info.value)
    assert "notes.txt" in str(info.value)
    assert edited.read_text() == "my edit\n"
    assert (upstream.tree / "notes.txt").read_text() == "mine\n"


def test_user_commits_go_to_a_backup_branch(upstream: Upstream, capsys):
    apply_series(upstream.series, upstream.tree, upstream.cache)
    upstream.commit_in_tree("vllm/mine.py", "mine = True\n", "My experiment")
    mine = git(upstream.tree, "rev-parse", "HEAD")
    upstream.series.overlay.joinpath("vllm/_fork.py").write_text("FORK = 'v2'\n")
    assert apply_series(upstream.series, upstream.tree, upstream.cache)
    backups = git(upstream.tree, "branch", "--list", "backup/*").split()
    assert len(backups) == 1
    assert git(upstream.tree, "rev-parse", backups[0]) == mine
    err = capsys.readouterr().err
    assert backups[0] in err and "My experiment" in err
    # The rebuilt branch no longer has it; a further apply keeps no second copy.
    assert "My experiment" not in git(upstream.tree, "log", "--format=%s")
    upstream.series.overlay.joinpath("vllm/_fork.py").write_text("FORK = 'v3'\n")
    apply_series(upstream.series, upstream.tree, upstream.cache)
    assert len(git(upstream.tree, "branch", "--list", "backup/*").split()) == 1


def test_commits_already_in_the_series_need_no_backup(upstream: Upstream):
    add_patch(upstream, "vllm/v1/core/new.py", "x = 1\n", "Add new module")
    # Re-make the same change by hand (another committer): same patch-id.
    git(upstream.tree, "reset", "-q", "--hard", "upstream/v9.9.9")
    upstream.commit_in_tree("vllm/v1/core/new.py", "x = 1\n", "Add new module")
    upstream.series.overlay.joinpath("vllm/_fork.py").write_text("FORK = 'v2'\n")
    apply_series(upstream.series, upstream.tree, upstream.cache)
    assert git(upstream.tree, "branch", "--list", "backup/*") == ""


def test_detached_head_work_is_kept(upstream: Upstream):
    apply_series(upstream.series, upstream.tree, upstream.cache)
    git(upstream.tree, "checkout", "-q", "--detach")
    upstream.commit_in_tree("vllm/mine.py", "mine = True\n", "Detached work")
    mine = git(upstream.tree, "rev-parse", "HEAD")
    upstream.series.overlay.joinpath("vllm/_fork.py").write_text("FORK = 'v2'\n")
    apply_series(upstream.series, upstream.tree, upstream.cache)
    backups = git(upstream.tree, "branch", "--list", "backup/*").split()
    assert [git(upstream.tree, "rev-parse", b) for b in backups] == [mine]


def test_a_foreign_directory_is_refused(upstream: Upstream):
    upstream.tree.mkdir()
    (upstream.tree / "keep.txt").write_text("x")
    with pytest.raises(ForkError, match="not a git checkout made by"):
        apply_series(upstream.series, upstream.tree, upstream.cache)
    git(upstream.tree, "init", "-q")
    with pytest.raises(ForkError, match="did not create"):
        apply_series(upstream.series, upstream.tree, upstream.cache)
    assert (upstream.tree / "keep.txt").read_text() == "x"


def test_base_checkout_has_no_patches(upstream: Upstream, tmp_path):
    add_patch(upstream, "vllm/v1/core/new.py", "x = 1\n", "Add new module")
    base_tree = tmp_path / "base"
    checkout_base(upstream.series, base_tree, upstream.cache)
    assert not (base_tree / "vllm/v1/core/new.py").exists()
    assert git(base_tree, "rev-parse", "HEAD") == git(
        upstream.tree, "rev-parse", "upstream/v9.9.9"
    )
