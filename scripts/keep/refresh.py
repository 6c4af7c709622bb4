#!/usr/bin/env python3
"""Write the series back from the commits in the patched tree.

This is how a patch is added or edited: `make apply`, change and commit in
vllm/ (one commit per logical change, `git commit --amend` or `git rebase
-i` to edit one), then `make refresh`. Every commit after the upstream base
becomes patches/NNNN-<subject>.patch, except the overlay commit (overlay
files are edited in overlay/). Output is byte-stable: refresh right after
apply changes nothing.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.apply import (
    OVERLAY_SUBJECT,
    check_clean,
    init_tree,
    make_hint,
    series_of_ref,
)
from keep.build_digests import DIGESTS_FILE
from lib.cli import main_guard, parser, say
from lib.errors import ForkError
from lib.paths import DEFAULT_TREE, rel
from lib.proc import git, git_ok, run
from lib.series import Series, add_series_arguments, series_from_arguments

# format-patch output must not depend on the user's git configuration.
ISOLATED_GIT = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
FORMAT_PATCH = [
    "-c",
    "diff.algorithm=myers",
    "-c",
    "diff.noprefix=false",
    "-c",
    "diff.mnemonicPrefix=false",
    "-c",
    "diff.renames=true",
    "format-patch",
    "-q",
    "-N",
    "--zero-commit",
    "--full-index",
    "--no-signature",
    "--no-binary",
    "--encode-email-headers",
]


def series_commits(tree: Path, series: Series) -> list[str]:
    """The tree's commits after the base that make up the series, in order."""
    base = series.base()
    has_base = git_ok(tree, "rev-parse", "-q", "--verify", base.tree_ref)
    if not has_base or not git_ok(
        tree, "merge-base", "--is-ancestor", base.tag, "HEAD"
    ):
        # Name the series the tree does hold, by make's variables.
        held = series_of_ref(tree, "HEAD", series)
        other = (
            f" It holds {held.base().version}: "
            f"`{make_hint('refresh', tree, held)}` writes that series back."
            if held is not series
            else ""
        )
        if git_ok(tree, "rev-parse", "-q", "--verify", f"refs/heads/{base.branch}"):
            instead = (
                f"check out its branch (git -C {rel(tree)} checkout {base.branch})"
            )
        else:
            instead = f"build it first (`{make_hint('apply', tree, series)}`)"
        raise ForkError(
            f"{rel(tree)}/ HEAD is not built on {base.tag}, the base pinned in "
            f"{rel(series.base_file)}.{other} To write {rel(series.dir)}/ "
            f"instead, {instead}."
        )
    # The overlay's files and the digests make apply writes beside them.
    overlay = {str(f) for f in series.overlay_files()} | {DIGESTS_FILE}
    commits = []
    for rev in git(tree, "rev-list", "--reverse", f"{base.tag}..HEAD").split():
        files = set(
            git(
                tree, "diff-tree", "--no-commit-id", "--name-only", "-r", "--root", rev
            ).split()
        )
        subject = git(tree, "log", "-1", "--format=%s", rev)
        if subject.startswith(OVERLAY_SUBJECT):
            if not files <= overlay:
                raise ForkError(
                    f"the overlay commit {rev[:12]} also changes "
                    f"{', '.join(sorted(files - overlay))}: move that into a "
                    "commit of its own"
                )
            continue
        if files & overlay:
            raise ForkError(
                f"commit {rev[:12]} ({subject}) changes files the overlay owns: "
                f"{', '.join(sorted(files & overlay))}. Edit those in overlay/."
            )
        commits.append(rev)
    return commits


def format_patches(
    tree: Path, commits: list[str], out: Path, start: int = 1
) -> list[Path]:
    """Write commits as NNNN-<subject>.patch into `out`, numbered from `start`."""
    files = []
    for number, rev in enumerate(commits, start):
        run(
            [
                "git",
                "-C",
                tree,
                *FORMAT_PATCH,
                "--start-number",
                str(number),
                "-o",
                out,
                "-1",
                rev,
            ],
            env=ISOLATED_GIT,
        )
        made = sorted(out.glob(f"{number:04d}-*.patch"))
        if len(made) != 1:
            raise ForkError(f"format-patch gave {len(made)} files for {rev[:12]}")
        files.append(made[0])
    return files


def refresh_series(series: Series, tree: Path = DEFAULT_TREE) -> dict[str, list[str]]:
    """Sync series.dir with the tree; return names added/updated/removed."""
    init_tree(tree)
    check_clean(tree, series)
    commits = series_commits(tree, series)
    changes: dict[str, list[str]] = {"added": [], "updated": [], "removed": []}
    with tempfile.TemporaryDirectory() as tmp:
        fresh = format_patches(tree, commits, Path(tmp))
        names = {f.name for f in fresh}
        for old in series.patches():
            if old.name not in names:
                old.path.unlink()
                changes["removed"].append(old.name)
        for f in fresh:
            dest = series.dir / f.name
            data = f.read_bytes()
            if not dest.exists():
                changes["added"].append(f.name)
            elif dest.read_bytes() != data:
                changes["updated"].append(f.name)
            else:
                continue
            dest.write_bytes(data)
    return changes


def main() -> int:
    p = parser(__doc__, tree="patched checkout to read")
    add_series_arguments(p)
    args = p.parse_args()
    series = series_from_arguments(args)
    changes = refresh_series(series, args.tree.resolve())
    total = len(series.patches())
    for kind, names in changes.items():
        for name in names:
            say(f"    {kind:8s} {rel(series.dir)}/{name}")
    if not any(changes.values()):
        say(f"{rel(series.dir)}/ unchanged ({total} patches)")
    else:
        say(f"{rel(series.dir)}/ now holds {total} patches; review with git diff")
    return 0


if __name__ == "__main__":
    main_guard(main)
