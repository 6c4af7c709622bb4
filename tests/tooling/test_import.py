"""make import: an upstream fix becomes the series' next numbered patch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from keep.apply import scratch_tree
from keep.import_patch import import_change, mails_from_repo, parse_mails
from keep.refresh import refresh_series
from lib.errors import ForkError
from lib.paths import ROOT
from lib.proc import git
from lib.series import Patch, Series, is_tracked
from shipenv import blob_text, commit_files, shared_clone

POOL = "vllm/v1/core/block_pool.py"
OUTSIDE = "vllm/config/cache.py"
REPRODUCER = (
    "tests/reproducers/test_no_free_blocks_error.py::"
    "test_refused_pop_is_typed_and_changes_nothing"
)


@pytest.fixture
def upstream(series, tree, tmp_path) -> dict[str, str]:
    """A clone of "vLLM" with upstream-style commits on the release."""
    repo = shared_clone(tree, tmp_path / "upstream")
    base = series.base().tag
    pool = blob_text(repo, base, POOL)
    fixed = pool.replace(
        '"""Get the number of free blocks in the pool.',
        '"""The number of free blocks in the pool (a counter, cheap).',
    )
    assert fixed != pool
    fix = commit_files(
        repo,
        base,
        {POOL: fixed, OUTSIDE: blob_text(repo, base, OUTSIDE) + "# elsewhere\n"},
        "[Core] Clarify get_num_free_blocks (#50001)\n\n"
        "Fixes #49999\n\nSigned-off-by: Up Stream <up@example.com>\n",
    )
    docs = commit_files(
        repo, fix, {"docs/README.md": "docs\n"}, "[Doc] Only docs (#50002)"
    )
    follow = commit_files(
        repo,
        docs,
        {POOL: fixed.replace("(a counter, cheap)", "(a counter)")},
        "[Core] Follow-up wording (#50003)",
    )
    git(repo, "update-ref", "refs/heads/main", follow)
    return {"repo": str(repo), "fix": fix, "docs": docs, "follow": follow}


@pytest.fixture
def copy(series, tmp_path) -> Series:
    """The series, copied: imports write into it."""
    dest = Series(tmp_path / "series")
    shutil.copytree(series.dir, dest.dir, ignore=shutil.ignore_patterns("v*"))
    return dest


def diff_paths(path: Path) -> set[str]:
    return {
        line.split(" b/", 1)[1]
        for line in path.read_text().splitlines()
        if line.startswith("diff --git ")
    }


def test_one_commit_becomes_the_next_patch(copy, upstream, tmp_path):
    before = copy.patches()
    mails = mails_from_repo(Path(upstream["repo"]), upstream["fix"])
    dest = import_change(copy, mails, "fix", reproducers=[REPRODUCER])
    number = max(p.number for p in before) + 1
    assert dest.name.startswith(f"{number:04d}-Core-Clarify-get_num_free_blocks")
    assert [p.name for p in copy.patches()] == [p.name for p in before] + [dest.name]
    assert diff_paths(dest) == {POOL}  # vllm/config is not tracked
    patch = Patch(dest)
    assert patch.trailers() == {
        "Signed-off-by": ["Up Stream <up@example.com>"],
        "Upstream-Status": [f"backport of upstream commit {upstream['fix'][:12]}"],
        "Upstream-Commit": [upstream["fix"]],
        "Upstream-PR": ["vllm-project/vllm#50001"],
        "Upstream-Issue": ["vllm-project/vllm#49999"],
        "Reproducer": [REPRODUCER],
    }
    assert patch.is_upstream()  # so `make export` skips it
    assert "From: Up Stream <up@example.com>" in dest.read_text()

    # The series applies, and refresh right after changes no byte.
    tree = scratch_tree(copy, tmp_path / "check")
    assert "(a counter, cheap)" in (tree / POOL).read_text()
    assert refresh_series(copy, tree) == {"added": [], "updated": [], "removed": []}

    # The same commit again, by id or as the same change: refused.
    with pytest.raises(ForkError, match="already in the series"):
        import_change(copy, mails, "fix")
    mbox = git(
        Path(upstream["repo"]), "format-patch", "--stdout", "-1", upstream["fix"]
    )
    anonymous = mbox.replace(upstream["fix"], "0" * 40, 1)
    with pytest.raises(ForkError, match="already in the series"):
        import_change(copy, parse_mails(anonymous, "fix.patch"), "fix.patch")
    assert len(copy.patches()) == len(before) + 1


def test_a_range_is_squashed_keeping_tracked_commits(copy, upstream):
    repo = Path(upstream["repo"])
    base = git(repo, "rev-parse", f"{upstream['fix']}~1")
    mails = mails_from_repo(repo, f"{base}..{upstream['follow']}")
    assert len(mails) == 2  # the docs-only commit is not in the tracked paths
    dest = import_change(copy, mails, "range", subject="[Core] Backport wording")
    text = dest.read_text()
    assert "Subject: [PATCH] [Core] Backport wording" in text
    assert f"- {upstream['fix'][:12]} [Core] Clarify" in text
    assert f"- {upstream['follow'][:12]} [Core] Follow-up" in text
    assert Patch(dest).trailers()["Upstream-Commit"] == [
        upstream["fix"],
        upstream["follow"],
    ]
    assert '+        """The number of free blocks in the pool (a counter).' in text


def test_an_mbox_file(copy, upstream, tmp_path):
    repo = Path(upstream["repo"])
    mbox = tmp_path / "fix.mbox"
    mbox.write_text(git(repo, "format-patch", "--stdout", "-1", upstream["fix"]) + "\n")
    dest = import_change(
        copy, parse_mails(mbox.read_text(), "fix.mbox"), "fix.mbox", issues=["7"]
    )
    assert diff_paths(dest) == {POOL}
    trailers = Patch(dest).trailers()
    assert trailers["Upstream-Commit"] == [upstream["fix"]]
    assert trailers["Upstream-Issue"] == ["vllm-project/vllm#7"]


def test_bad_input_is_a_clear_error(copy, upstream, tmp_path):
    repo = Path(upstream["repo"])
    names = [p.name for p in copy.patches()]
    with pytest.raises(ForkError, match="is not a patch"):
        parse_mails("just some text\n", "notes.txt")
    bare = git(repo, "diff", f"{upstream['fix']}~1", upstream["fix"])
    with pytest.raises(ForkError, match="without an author and message"):
        parse_mails(bare, "bare.diff")
    with pytest.raises(ForkError, match="touches none of the paths"):
        mails_from_repo(repo, upstream["docs"])
    docs_mbox = git(repo, "format-patch", "--stdout", "-1", upstream["docs"])
    with pytest.raises(ForkError, match="touches none of the paths"):
        import_change(copy, parse_mails(docs_mbox, "docs.patch"), "docs.patch")
    with pytest.raises(ForkError, match="is not a commit or range"):
        mails_from_repo(repo, "no-such-ref")
    with pytest.raises(ForkError, match="not a git repository"):
        mails_from_repo(tmp_path, "HEAD")
    assert [p.name for p in copy.patches()] == names  # nothing written


def test_a_change_that_does_not_apply(copy, upstream, series, tmp_path):
    repo = Path(upstream["repo"])
    base = series.base().tag
    other = commit_files(
        repo,
        base,
        {POOL: blob_text(repo, base, POOL).replace("class BlockPool", "class Pool")},
        "[Core] Rename",
    )
    clash = commit_files(
        repo,
        other,
        {POOL: blob_text(repo, other, POOL).replace("class Pool:", "class P:")},
        "[Core] Rename again",
    )
    names = [p.name for p in copy.patches()]
    with pytest.raises(ForkError, match="does not apply to the series"):
        import_change(copy, mails_from_repo(repo, clash), "clash")
    assert [p.name for p in copy.patches()] == names


def test_tracked_paths():
    assert is_tracked("vllm/v1/core/block_pool.py")
    assert is_tracked("tests/v1/simple_kv_offload/test_x.py")
    assert not is_tracked("vllm/v1/core_extra.py")
    assert not is_tracked("vllm/config/cache.py")


def test_cli_errors_exit_non_zero(tmp_path):
    script = ROOT / "scripts" / "keep" / "import_patch.py"
    helped = subprocess.run([sys.executable, script, "--help"], capture_output=True)
    assert helped.returncode == 0
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    proc = subprocess.run(
        [sys.executable, script, str(notes), "--series", str(tmp_path / "s")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "notes.txt is not a patch" in proc.stderr
