#!/usr/bin/env python3
"""Build the patched vLLM tree: upstream base + one commit per patch + overlay.

The tree (default vllm/) is a git checkout on branch fork/v<version>:
the imported upstream commit, each patch applied with `git am -3`, and the
overlay files in a last commit that records the series fingerprint. Running
it again with nothing changed does nothing.

Your work in the tree is never thrown away: uncommitted edits or an
unfinished git operation make it refuse, and commits of yours that are not
in the series are kept on a backup/ branch before the branch is rebuilt.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.fetch import ensure_base
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import CACHE, DEFAULT_TREE, rel
from lib.proc import TOOL_EMAIL, git, git_ok, run, tool_identity_env
from lib.series import Base, Series, add_series_arguments, series_from_arguments

MANAGED_KEY = "vllm-fork.managed"
# `make rebase` keeps its state here, in the tree's git directory.
REBASE_STATE = "vllm-fork-rebase.json"
OVERLAY_SUBJECT = "fork: overlay"
FINGERPRINT_TRAILER = "Series-Fingerprint"


def init_tree(tree: Path) -> None:
    """Create the tree's repository, or check an existing one is ours."""
    if not tree.exists():
        run(["git", "init", "-q", tree])
        git(tree, "config", MANAGED_KEY, "true")
        return
    if not (tree / ".git").exists():
        raise ForkError(
            f"{rel(tree)}/ exists but is not a git checkout made by `make apply`.\n"
            f"Move it aside (e.g. mv {rel(tree)} {rel(tree)}.old) and run again."
        )
    if git(tree, "config", "--get", MANAGED_KEY, check=False) != "true":
        raise ForkError(
            f"{rel(tree)}/ is a git checkout that `make apply` did not create.\n"
            f"Move it aside (e.g. mv {rel(tree)} {rel(tree)}.old) and run again."
        )


def operation_in_progress(tree: Path) -> str | None:
    gitdir = Path(git(tree, "rev-parse", "--absolute-git-dir"))
    if (gitdir / "rebase-apply" / "applying").exists():
        return "git am"
    if (gitdir / "rebase-apply").exists() or (gitdir / "rebase-merge").exists():
        return "git rebase"
    for head, name in (
        ("MERGE_HEAD", "git merge"),
        ("CHERRY_PICK_HEAD", "cherry-pick"),
    ):
        if (gitdir / head).exists():
            return name
    return None


def fetch_base(tree: Path, base: Base, upstream: Path) -> None:
    """Bring the upstream commit into the tree as refs/remotes/<base.tag>."""
    if git_ok(tree, "rev-parse", "-q", "--verify", f"refs/tags/{base.tag}"):
        git(tree, "tag", "-d", base.tag)  # trees made before this layout
    git(
        tree,
        "fetch",
        "-q",
        "--no-tags",
        str(upstream),
        f"+refs/tags/{base.tag}:{base.tree_ref}",
    )


def make_hint(target: str, tree: Path) -> str:
    """The make command for `target` on this tree (TREE= when not vllm/)."""
    same = tree.resolve() == DEFAULT_TREE.resolve()
    return f"make {target}" + ("" if same else f" TREE={rel(tree)}")


def rebase_in_progress(tree: Path) -> str | None:
    """The version a `make rebase` in the tree is moving to, if one is."""
    state = Path(git(tree, "rev-parse", "--absolute-git-dir")) / REBASE_STATE
    if not state.is_file():
        return None
    try:
        return json.loads(state.read_text())["new_base"]["version"]
    except (ValueError, KeyError):
        return "?"


def check_clean(tree: Path) -> None:
    moving_to = rebase_in_progress(tree)
    if moving_to:
        raise ForkError(
            f"{rel(tree)}/ is in the middle of `make rebase` onto {moving_to}. "
            f"Finish it (resolve, then `{make_hint('rebase-continue', tree)}`) or "
            f"undo it (`{make_hint('rebase-abort', tree)}`)."
        )
    op = operation_in_progress(tree)
    if op:
        raise ForkError(
            f"{rel(tree)}/ is in the middle of a {op}. Finish it "
            f"(`{op.split()[-1]} --continue` after resolving) and run `make refresh`,"
            f" or abort it (`git -C {rel(tree)} {op.split()[-1]} --abort`)."
        )
    dirty = git(tree, "status", "--porcelain", "--untracked-files=normal")
    if dirty:
        lines = dirty.splitlines()
        shown = "\n".join(f"  {line}" for line in lines[:10])
        more = f"\n  ... and {len(lines) - 10} more" if len(lines) > 10 else ""
        raise ForkError(
            f"{rel(tree)}/ has uncommitted changes:\n{shown}{more}\n"
            "Nothing was changed. Commit them (and `make refresh` to put them in "
            f"the series) or stash them (`git -C {rel(tree)} stash -u`), then run "
            "again."
        )


def head_fingerprint(tree: Path) -> str | None:
    if not git_ok(tree, "rev-parse", "-q", "--verify", "HEAD"):
        return None
    msg = git(tree, "log", "-1", "--format=%B")
    for line in msg.splitlines():
        if line.startswith(f"{FINGERPRINT_TRAILER}: "):
            return line.split(": ", 1)[1].strip()
    return None


def patch_ids(tree: Path, diffs: str) -> set[str]:
    out = git(tree, "patch-id", "--stable", input=diffs)
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def unsaved_commits(tree: Path, head: str, exclude: str, series: Series) -> list[str]:
    """Commits reachable only from `head` that apply would lose.

    A commit is safe to drop when the tooling made it (its committer) or
    when an identical change is a patch of the series (same patch-id).
    """
    revs = git(
        tree,
        "rev-list",
        head,
        "--not",
        f"--exclude={exclude}",
        "--branches",
        "--tags",
        "--remotes",
    ).split()
    if not revs:
        return []
    known = patch_ids(tree, "".join(p.path.read_text() for p in series.patches()))
    lost = []
    for rev in revs:
        if git(tree, "log", "-1", "--format=%ce", rev) == TOOL_EMAIL:
            continue
        ids = patch_ids(tree, git(tree, "show", "--format=", rev) + "\n")
        if not ids or not ids <= known:
            lost.append(rev)
    return lost


def keep_user_work(tree: Path, base: Base, series: Series) -> None:
    """Put commits that a rebuild would drop on a backup branch, and say so."""
    candidates = []
    if git_ok(tree, "rev-parse", "-q", "--verify", f"refs/heads/{base.branch}"):
        candidates.append((base.branch, base.branch))
    if not git_ok(tree, "symbolic-ref", "-q", "HEAD") and git_ok(
        tree, "rev-parse", "-q", "--verify", "HEAD"
    ):
        candidates.append(("detached HEAD", "HEAD"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for label, ref in candidates:
        lost = unsaved_commits(tree, ref, ref, series)
        if not lost:
            continue
        backup = f"backup/{base.branch.replace('/', '-')}-{stamp}"
        if label == "detached HEAD":
            backup += "-detached"
        git(tree, "branch", backup, ref)
        subjects = [git(tree, "log", "-1", "--format=%h %s", r) for r in lost]
        say(
            f"warning: {label} in {rel(tree)}/ had {len(lost)} commit(s) that are "
            f"not in the series; they are kept on branch {backup}:\n"
            + "\n".join(f"    {s}" for s in subjects)
            + "\n  To add them to the series: git -C "
            f"{rel(tree)} checkout {backup} && make refresh"
        )


def conflict_error(tree: Path, base: Base, patches: list) -> ForkError:
    gitdir = Path(git(tree, "rev-parse", "--absolute-git-dir"))
    try:
        index = int((gitdir / "rebase-apply" / "next").read_text()) - 1
        name = f"{patches[index].name} ({index + 1} of {len(patches)})"
    except (OSError, ValueError, IndexError):
        name = "a patch"
    files = git(tree, "diff", "--name-only", "--diff-filter=U").split()
    if not files:
        diff = git(tree, "am", "--show-current-patch=diff", check=False)
        files = sorted(
            {
                line.split(" b/", 1)[1]
                for line in diff.splitlines()
                if line.startswith("diff --git ")
            }
        )
    t = rel(tree)
    return ForkError(
        f"patch {name} does not apply to upstream vLLM {base.version}.\n"
        "Conflicting files:\n"
        + "".join(f"  {t}/{f}\n" for f in files)
        + f"{t}/ is left mid-apply so you can resolve it:\n"
        f"  1. fix the files, then: git -C {t} add <files>\n"
        f"  2. git -C {t} am --continue     (applies the remaining patches)\n"
        "  3. make refresh                  (writes the resolved series back)\n"
        "  4. make apply                    (adds the overlay)\n"
        f"Or undo with: git -C {t} am --abort"
    )


def git_am(tree: Path, patch_files: list[Path], three_way: bool = True):
    """`git am` the patch files onto HEAD the way the series is built: the
    tool's committer identity and dates taken from the patches, so the same
    patches on the same base give the same commit ids everywhere. Returns
    the finished process; on failure the am is left in progress."""
    return run(
        [
            "git",
            "-C",
            tree,
            "-c",
            "commit.gpgsign=false",
            "am",
            "-q",
            *(["-3"] if three_way else []),
            "--keep-non-patch",
            "--committer-date-is-author-date",
            *patch_files,
        ],
        # LC_ALL=C: callers read git's messages (rerere's, for one).
        env={**tool_identity_env(), "LC_ALL": "C"},
        check=False,
    )


def lay_overlay(tree: Path, series: Series, fingerprint: str, date: str) -> None:
    files = series.overlay_files()
    for f in files:
        dest = tree / f
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(series.overlay / f, dest)
    if files:
        git(tree, "add", "-f", "--", *map(str, files))
    message = (
        f"{OVERLAY_SUBJECT} ({len(files)} files)\n\n"
        "Files the fork owns outright, laid over the patched tree.\n\n"
        f"{FINGERPRINT_TRAILER}: {fingerprint}\n"
    )
    git(
        tree,
        "commit",
        "-q",
        "--allow-empty",
        "--no-verify",
        "-m",
        message,
        env=tool_identity_env(date),
    )


def apply_series(
    series: Series,
    tree: Path = DEFAULT_TREE,
    cache: Path = CACHE,
    source: str | None = None,
) -> bool:
    """Build `tree` from `series`. Returns False when it was already up to date."""
    base = series.base()
    patches = series.patches()
    fingerprint = series.fingerprint()
    init_tree(tree)
    check_clean(tree)
    on_branch = git(tree, "symbolic-ref", "-q", "--short", "HEAD", check=False)
    # A tree made before the base moved to refs/remotes/ is rebuilt once.
    has_base = git_ok(tree, "rev-parse", "-q", "--verify", base.tree_ref)
    if on_branch == base.branch and head_fingerprint(tree) == fingerprint and has_base:
        say(
            f"{rel(tree)}/ is up to date ({base.branch}, {len(patches)} patches, "
            f"series {fingerprint}); nothing to do"
        )
        return False

    fetch_base(tree, base, ensure_base(base, series.base_file, cache, source))

    keep_user_work(tree, base, series)
    step(
        f"building {rel(tree)}/ on branch {base.branch}: upstream vLLM "
        f"{base.version} + {len(patches)} patches + overlay"
    )
    git(tree, "checkout", "-q", "-B", base.branch, base.tag)
    if patches:
        for i, p in enumerate(patches, 1):
            say(f"    [{i}/{len(patches)}] {p.name}")
        if git_am(tree, [p.path for p in patches]).returncode != 0:
            raise conflict_error(tree, base, patches)
    date = git(tree, "log", "-1", "--format=%ad", "--date=raw")
    lay_overlay(tree, series, fingerprint, date)
    # setuptools-scm takes the installed version from the nearest vX.Y.Z tag:
    # the patched tree installs as X.Y.Z (plus vLLM's +empty/+precompiled).
    git(tree, "tag", "-f", f"v{base.version}", "HEAD")
    say(
        f"{rel(tree)}/ ready: {git(tree, 'rev-parse', '--short', 'HEAD')} "
        f"({base.branch}, series {fingerprint})"
    )
    return True


def scratch_tree(series: Series, dest: Path, cache: Path = CACHE) -> Path:
    """A throwaway tree built from `series` in the new directory `dest`.

    It borrows the objects of the cache repository (git clone --shared)
    instead of copying them: seconds instead of a full import. Only for
    short-lived trees, which the cache must outlive.
    """
    base = series.base()
    upstream = ensure_base(base, series.base_file, cache)
    run(
        ["git", "clone", "-q", "--shared", "--no-checkout", "--no-tags", upstream, dest]
    )
    git(dest, "config", MANAGED_KEY, "true")
    apply_series(series, dest, cache)
    return dest


def checkout_release(
    base: Base, base_file: Path, tree: Path, cache: Path = CACHE
) -> None:
    """Make `tree` a detached checkout of the bare upstream release `base`."""
    init_tree(tree)
    check_clean(tree)
    if git(tree, "rev-parse", "HEAD", check=False) == git(
        tree, "rev-parse", f"{base.tag}^{{commit}}", check=False
    ):
        return
    fetch_base(tree, base, ensure_base(base, base_file, cache))
    git(tree, "checkout", "-q", "--detach", base.tag)


def checkout_base(series: Series, tree: Path, cache: Path = CACHE) -> None:
    """Make `tree` a checkout of the series' bare upstream base (no patches)."""
    checkout_release(series.base(), series.base_file, tree, cache)


def main() -> int:
    p = parser(__doc__, tree="checkout to build")
    add_series_arguments(p)
    p.add_argument(
        "--source",
        choices=("sdist", "git"),
        help="where the upstream base comes from (default: what base.toml pins)",
    )
    args = p.parse_args()
    apply_series(series_from_arguments(args), args.tree.resolve(), source=args.source)
    return 0


if __name__ == "__main__":
    main_guard(main)
