"""One patch of a rebase, replayed on the new release and classified.

`replay_one` applies a patch at HEAD (the new release plus the patches kept
so far) and says what became of it, as an `Outcome` in one of the states
CLEAN, MERGED, UPSTREAM or CONFLICT (PENDING: not replayed yet): the
reproducers' verdicts first, then `git apply --check`, reverse-apply,
`git am -3`, a recorded port, rerere. Here too are the `git am` helpers it
uses, `stale_adaptation` (a hand port for the patch's files that what
applied lacks) and `build_old_series` (the old series in the tree, for
`git am -3` to merge from).

Separate from rebase.py, the state machine that drives it, stops and
resumes: `make matrix` replays patches the same way with no rebase in
progress, and imports this module alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from keep.apply import git_am
from keep.resolutions import (
    PORT_DIFF,
    apply_port,
    gitdir,
    has_port,
    merge_rr,
    patch_paths,
    stale_port,
)
from lib.errors import ForkError
from lib.paths import rel
from lib.proc import git, git_ok, run, tool_identity_env
from lib.series import Base, Series

CLEAN, MERGED, UPSTREAM, CONFLICT, PENDING = (
    "clean",
    "merged",
    "upstream",
    "conflict",
    "pending",
)
OLD_SERIES_REF = "refs/vllm-fork/old-series"


@dataclass
class Outcome:
    """What happened to one patch."""

    state: str
    detail: str
    files: list[str] = field(default_factory=list)
    conflicts: dict[str, str] = field(default_factory=dict)  # rerere id -> path
    port: str = ""


def head(tree: Path) -> str:
    return git(tree, "rev-parse", "HEAD")


def unmerged_files(tree: Path) -> list[str]:
    return sorted(set(git(tree, "diff", "--name-only", "--diff-filter=U").split()))


def am_in_progress(tree: Path) -> bool:
    return (gitdir(tree) / "rebase-apply" / "applying").exists()


def am(tree: Path, *args: str) -> None:
    run(
        ["git", "-C", tree, "-c", "commit.gpgsign=false", "am", *args],
        env=tool_identity_env(),
    )


def commit_resolution(
    tree: Path, before: str, how: str, version: str, port: str
) -> Outcome:
    """Finish the stopped `git am` of one patch whose conflicts are resolved
    and staged (its port recorded as `port`): record the hunks' resolutions,
    then commit, or skip the patch when the resolution keeps the new
    release's code unchanged."""
    conflicts = merge_rr(tree)
    run(["git", "-C", tree, "rerere"], check=False)  # records the postimages
    if git_ok(tree, "diff", "--cached", "--quiet", before):
        am(tree, "--skip")
        return Outcome(
            UPSTREAM,
            f"resolved to {version}'s code ({how}): nothing left to change",
            conflicts=conflicts,
            port=port,
        )
    am(tree, "--continue")
    return Outcome(MERGED, how, conflicts=conflicts, port=port)


def reproducers_pass(ids: list[str], verdicts: dict[str, list[str]]) -> bool:
    return bool(ids) and all(verdicts.get(t, [""])[0] == "passes" for t in ids)


def adapted(tree: Path, patch: Path, before: str) -> Outcome | None:
    """A patch that applied, whose recorded port (an adaptation made with
    EDIT=, see `rebase.advance`) replaces what it applied: the commit is
    amended to the port. None if no port is recorded for it on these files."""
    if not has_port(tree, patch, before):
        return None
    committed = head(tree)
    git(tree, "reset", "-q", "--soft", before)
    port = apply_port(tree, patch, before)
    # The patch's message and author, on the port's files.
    run(
        ["git", "-C", tree, "commit", "-q", "--no-verify", "-C", committed],
        env=committer_env(),
    )
    return Outcome(MERGED, "recorded adaptation", port=port)


def committer_env() -> dict[str, str]:
    """The tooling's identity as committer (the author stays the patch's)."""
    return {
        k: v for k, v in tool_identity_env().items() if k.startswith("GIT_COMMITTER")
    }


def replay_one(
    tree: Path, patch: Path, ids: list[str], verdicts: dict, version: str
) -> Outcome:
    """Classify one patch against HEAD (the new release plus the patches kept
    so far), applying it when it is still needed. A conflict leaves the `git
    am` in progress."""
    if reproducers_pass(ids, verdicts):
        return Outcome(
            UPSTREAM, f"fixed in {version}: its {len(ids)} reproducer(s) pass there"
        )
    before = head(tree)
    if git_ok(tree, "apply", "--check", str(patch)):
        proc = git_am(tree, [patch], three_way=False)
        if proc.returncode != 0:
            raise ForkError(f"git am of {patch.name} failed:\n{proc.stderr}")
        return adapted(tree, patch, before) or Outcome(CLEAN, "applies as it is")
    if git_ok(tree, "apply", "--check", "--reverse", str(patch)):
        return Outcome(
            UPSTREAM, f"its change is already in {version} (reverse-applies)"
        )
    proc = git_am(tree, [patch])
    if proc.returncode == 0:
        if head(tree) == before:
            return Outcome(
                UPSTREAM, f"its change is already in {version} (empty after merge)"
            )
        return adapted(tree, patch, before) or Outcome(MERGED, "three-way merge")
    if am_in_progress(tree) and (port := apply_port(tree, patch, before)):
        return commit_resolution(tree, before, "recorded resolution", version, port)
    conflicts = merge_rr(tree)
    files = unmerged_files(tree)
    # rerere replayed recorded resolutions for every conflict and staged them
    # (it then drops them from MERGE_RR, so its message is what tells).
    if (
        am_in_progress(tree)
        and not files
        and "using previous resolution" in proc.stderr
    ):
        if stale := stale_port(tree, patch, before, Base(version).tree_ref):
            # (A patch that now merges without conflicts cannot be caught
            # here: its earlier port is not consulted.)
            return Outcome(
                CONFLICT,
                "rerere replayed its conflicts' resolutions, but the patch "
                f"changed since it was ported by hand ({stale / PORT_DIFF}): "
                "make the staged files carry that port's other edits too",
                files=patch_paths(patch),
                conflicts=conflicts,
            )
        return commit_resolution(tree, before, "recorded resolution", version, "")
    reason = "" if conflicts else (proc.stderr.strip().splitlines() or [""])[-1]
    return Outcome(
        CONFLICT,
        f"conflicts in {len(files)} file(s)" if files else f"does not apply: {reason}",
        files=files or patch_paths(patch),
        conflicts=conflicts,
    )


def stale_adaptation(tree: Path, patch: Path, version: str) -> Path | None:
    """A port made by hand for `patch` on this release's files (an EDIT=
    adaptation, or a resolution) whose edits the patch as it applied does
    not carry: the patch changed since, and applying it clean would drop
    the adaptation in silence. None when there is none, or all its changed
    lines are in the commit."""
    stale = stale_port(
        tree, patch, git(tree, "rev-parse", "HEAD~1"), Base(version).tree_ref
    )
    if stale is None:
        return None
    committed = changed_lines(git(tree, "show", "--format=", "HEAD"))
    port = changed_lines((stale / PORT_DIFF).read_text())
    return None if port <= committed else stale


def changed_lines(diff: str) -> set[str]:
    """The lines a diff adds or removes (its file headers left out)."""
    return {
        line
        for line in diff.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++ ", "--- "))
    }


def build_old_series(tree: Path, series: Series) -> None:
    """Apply the series on its own base, detached, so that the tree holds
    every file version the patches were made from: `git am -3` merges from
    those. Kept under refs/vllm-fork/ so that no gc takes them meanwhile."""
    git(tree, "checkout", "-q", "--detach", series.base().tag)
    patches = [p.path for p in series.patches()]
    if patches and git_am(tree, patches).returncode != 0:
        run(["git", "-C", tree, "am", "--abort"], check=False)
        raise ForkError(
            f"{rel(series.dir)}/ does not apply to its own base "
            f"{series.base().version}: fix the series first (make apply)"
        )
    git(tree, "update-ref", OLD_SERIES_REF, "HEAD")
