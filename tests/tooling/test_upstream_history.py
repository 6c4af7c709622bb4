"""standin, upstream_cut, bisect_upstream and canary on a synthetic upstream.

The synthetic series of five patches (conftest) on 9.9.9, and an upstream
history of its own: 9.9.9, a docs-only commit, the commit that fixes patch
3's bug (with a PR number), a refactor, tagged 9.9.10. No network.
"""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import NEW_RELEASE, REPRODUCER, UPSTREAM_FILES, git

from keep import bisect_upstream, canary, upstream_cut
from keep.standin import build_standin
from lib.series import Series

UTILS = "vllm/v1/core/kv_cache_utils.py"
FIX_SUBJECT = "[Core] Raise ValueError on an empty pop (#4242)"


def commit_files(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def synthetic_upstream(tmp_path: Path) -> tuple[Path, str]:
    """The history, and the id of the fixing commit."""
    repo = tmp_path / "upstream-clone"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit_files(repo, UPSTREAM_FILES, "Initial")
    git(repo, "tag", "v9.9.9")
    commit_files(repo, {"docs/notes.md": "notes\n"}, "[Doc] Notes (#1)")
    fix = commit_files(
        repo,
        {
            "vllm/v1/core/kv_cache_utils.py": NEW_RELEASE[
                "vllm/v1/core/kv_cache_utils.py"
            ]
        },
        FIX_SUBJECT,
    )
    rest = {k: v for k, v in NEW_RELEASE.items() if "kv_cache_utils" not in k}
    commit_files(repo, rest, "[Core] Refactor the block pool (#5)")
    git(repo, "tag", "v9.9.10")
    return repo, fix


def test_the_standin_is_one_linear_commit_per_release(five, tmp_path):
    newer = tmp_path / "patches-v9.9.10"
    newer.mkdir()
    (newer / "base.toml").write_text(five.release("9.9.10", NEW_RELEASE).to_toml())
    both = [five.series, Series(newer)]
    out = build_standin(tmp_path / "standin.git", both, five.cache)
    assert git(out, "log", "--format=%s", "main").splitlines() == [
        "vLLM 9.9.10 (the commits since 9.9.9)",
        "vLLM 9.9.9",
    ]
    assert git(out, "rev-parse", "v9.9.10^") == git(out, "rev-parse", "v9.9.9")
    # A clone checks main out.
    assert git(out, "symbolic-ref", "HEAD") == "refs/heads/main"
    assert git(out, "show", "v9.9.10:vllm/v1/core/new.py") == "x = 1"
    # The same sdists give the same history.
    again = build_standin(tmp_path / "again.git", both, five.cache)
    assert git(again, "rev-parse", "main") == git(out, "rev-parse", "main")


def test_cut_keeps_what_the_reproducers_import_and_the_patches_change(
    five, project, tmp_path
):
    repo, _ = synthetic_upstream(tmp_path)
    result = upstream_cut.make_cut(
        str(repo),
        tmp_path / "cut.git",
        [five.series],
        repro_root=project,
        python=Path(sys.executable),
    )
    assert result["closure_at"] == ["v9.9.9"]
    assert {
        "vllm/__init__.py",
        "vllm/v1/core/kv_cache_utils.py",
        "vllm/v1/core/block_pool.py",
        "vllm/v1/core/new.py",
    } <= set(result["paths"])
    assert result["before"]["commits"] == 4
    # The docs-only commit is gone; the source is untouched.
    assert result["after"]["commits"] == 3
    cut = tmp_path / "cut.git"
    assert "[Doc] Notes (#1)" not in git(cut, "log", "--format=%s", "main")
    assert git(cut, "ls-tree", "-r", "--name-only", "main", "docs") == ""
    assert git(repo, "rev-list", "--count", "main") == "4"


def test_bisect_finds_the_fixing_commit_and_its_release(five, project, tmp_path):
    repo, fix = synthetic_upstream(tmp_path)
    cut = tmp_path / "cut.git"
    upstream_cut.make_cut(
        str(repo), cut, [five.series], repro_root=project, python=Path(sys.executable)
    )
    patch = bisect_upstream.find_patch(five.series, "3")
    assert patch.reproducers() == [REPRODUCER]
    result = bisect_upstream.bisect(
        patch,
        "v9.9.9",
        cut,
        tmp_path / "bisect",
        repro_root=project,
        python=Path(sys.executable),
    )
    assert (result["fails_on"], result["passes_on"]) == ("v9.9.9", "v9.9.10")
    assert result["subject"] == FIX_SUBJECT
    # Named by its id in the history that was cut, not the cut's own.
    assert result["commit"] == fix != result["cut_commit"]
    assert result["pr"] == "#4242" and result["first_release"] == "9.9.10"
    assert bisect_upstream.trailer(result) == (
        f"Upstream-Status: fixed upstream in {fix[:12]} (#4242), "
        "first released in 9.9.10"
    )


def test_canary_reports_each_patch_on_upstream_main(five, project, tmp_path):
    repo, _ = synthetic_upstream(tmp_path)
    result = canary.canary(
        five.series,
        str(repo),
        "main",
        out=tmp_path / "canary",
        repro_root=project,
        python=Path(sys.executable),
        cache=five.cache,
        work=tmp_path / "work",
    )
    verdicts = [e["verdict"] for e in result["patches"]]
    assert verdicts == ["applies", "applies", "redundant", "redundant", "conflicts"]
    assert not canary.ok(result)
    md = (tmp_path / "canary" / "canary.md").read_text()
    assert "| 0005-Conflict-change-line-20.patch | conflicts |" in md
    assert "its reproducers pass on the bare ref" in md
    assert "2 applies, 2 redundant, 1 conflicts" in md


def test_canary_on_the_series_own_base_needs_every_patch(five, project, tmp_path):
    repo, _ = synthetic_upstream(tmp_path)
    result = canary.canary(
        five.series,
        str(repo),
        "v9.9.9",
        out=tmp_path / "canary",
        repro_root=project,
        python=Path(sys.executable),
        cache=five.cache,
        work=tmp_path / "work",
    )
    assert [e["verdict"] for e in result["patches"]] == ["applies"] * 5
    # The reproducer fails on the bare ref and passes with the series.
    assert result["patches"][2]["with_series"] == {REPRODUCER: "passes"}
    assert canary.ok(result)
