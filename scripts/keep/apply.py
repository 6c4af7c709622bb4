#!/usr/bin/env python3
"""Build the patched vLLM tree: upstream base + one commit per patch + overlay.

The tree (default vllm/) is a git checkout on branch fork/v<version>:
the imported upstream commit, each patch applied with `git am -3`, and the
overlay files in a last commit that records the series fingerprint. Running
it again with nothing changed does nothing.

Your work in the tree is never thrown away: uncommitted edits or an
unfinished git operation make it refuse, and commits of yours that are not
in the series are kept on a backup/ branch before the branch is rebuilt.

A build cut short (Ctrl-C, a kill, a timeout) leaves a marker in the tree's
git directory; the next run takes its own half-done work back and builds
again (keep/interrupted.py), whichever release it is asked for.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep import interrupted
from keep.build_digests import DIGESTS_FILE, write_digests
from keep.fetch import ensure_base
from keep.fix_ids import apply_labels, progress_label
from keep.tree_release import (
    DIR_TRAILER,
    FINGERPRINT_TRAILER,
    OVERLAY_SUBJECT,
    RELEASE_TRAILER,
    announce_choice,
    release_from_history,
    series_recorded_at,
    stale_install,
)
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import CACHE, DEFAULT_TREE, OVERLAY, ROOT, rel
from lib.proc import TOOL_EMAIL, git, git_ok, run, tool_identity_env
from lib.series import (
    Base,
    Series,
    add_series_arguments,
    series_for_version,
    series_from_arguments,
)

MANAGED_KEY = "vllm-fork.managed"
# `make rebase` keeps its state here, in the tree's git directory.
REBASE_STATE = "vllm-fork-rebase.json"


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
        if fresh_repository(tree):
            # `git init` done, the key not yet set: a first run cut short.
            git(tree, "config", MANAGED_KEY, "true")
            return
        raise ForkError(
            f"{rel(tree)}/ is a git checkout that `make apply` did not create.\n"
            f"Move it aside (e.g. mv {rel(tree)} {rel(tree)}.old) and run again."
        )


def fresh_repository(tree: Path) -> bool:
    """An empty repository: no ref, no file beside .git; nothing to lose."""
    if any(p.name != ".git" for p in tree.iterdir()):
        return False
    return not git(tree, "for-each-ref", "--count=1", check=False) and not git_ok(
        tree, "rev-parse", "-q", "--verify", "HEAD"
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


def make_hint(target: str, tree: Path, series: Series | None = None) -> str:
    """The make command for `target` on this tree, as typed: TREE= when not
    vllm/, and the series by make's variables (VERSION=, or SERIES= for a
    directory that is not a release's own), never by the scripts' flags."""
    words = [f"make {target}"]
    if series is not None:
        words.append(series_variable(series))
    if tree.resolve() != DEFAULT_TREE.resolve():
        words.append(f"TREE={rel(tree)}")
    return " ".join(words)


def series_variable(series: Series) -> str:
    """VERSION=<release> for a release's own series, else SERIES=<dir>."""
    version = series.base().version
    try:
        if series_for_version(version).dir.resolve() == series.dir.resolve():
            return f"VERSION={version}"
    except ForkError:
        pass
    return f"SERIES={rel(series.dir)}"


def rebase_in_progress(tree: Path) -> str | None:
    """The version a `make rebase` in the tree is moving to, if one is."""
    state = Path(git(tree, "rev-parse", "--absolute-git-dir")) / REBASE_STATE
    if not state.is_file():
        return None
    try:
        return json.loads(state.read_text())["new_base"]["version"]
    except (ValueError, KeyError):
        return "?"


def check_clean(tree: Path, series: Series | None = None) -> None:
    """Refuse a tree with work in it that is not a finished build: a rebase,
    a git operation, uncommitted changes, an interrupted `make apply`.
    `series` (the one the caller acts on) makes the hints name it."""
    marker = interrupted.read_marker(tree)
    if marker:
        again = f"make apply {marker_variable(marker)}".strip()
        if tree.resolve() != DEFAULT_TREE.resolve():
            again += f" TREE={rel(tree)}"
        raise ForkError(
            f"{rel(tree)}/ is half-built: a `make apply` (building "
            f"{marker.get('release', '?')}) was interrupted. Nothing was changed. "
            f"Run `{again}` to finish it first."
        )
    moving_to = rebase_in_progress(tree)
    if moving_to:
        raise ForkError(
            f"{rel(tree)}/ is in the middle of `make rebase` onto {moving_to}. "
            f"Finish it (resolve, then `{make_hint('rebase-continue', tree)}`) or "
            f"undo it (`{make_hint('rebase-abort', tree)}`)."
        )
    op = operation_in_progress(tree)
    if op:
        verb = "am" if op == "git am" else op.split()[-1]
        refresh = make_hint("refresh", tree, series)
        raise ForkError(
            f"{rel(tree)}/ is in the middle of a {op}. Finish it "
            f"(`git -C {rel(tree)} {verb} --continue` after resolving) and run "
            f"`{refresh}`, or abort it (`git -C {rel(tree)} {verb} --abort`)."
        )
    dirty = git(tree, "status", "--porcelain", "--untracked-files=normal")
    if dirty:
        lines = dirty.splitlines()
        shown = "\n".join(f"  {line}" for line in lines[:10])
        more = f"\n  ... and {len(lines) - 10} more" if len(lines) > 10 else ""
        raise ForkError(
            f"{rel(tree)}/ has uncommitted changes:\n{shown}{more}\n"
            "Nothing was changed. Commit them (and "
            f"`{make_hint('refresh', tree, series)}` to put them in the series) or "
            f"stash them (`git -C {rel(tree)} stash -u`), then run again."
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
        refresh = make_hint("refresh", tree, series_of_ref(tree, ref, series))
        subjects = [git(tree, "log", "-1", "--format=%h %s", r) for r in lost]
        say(
            f"warning: {label} in {rel(tree)}/ had {len(lost)} commit(s) that are "
            f"not in the series; they are kept on branch {backup}:\n"
            + "\n".join(f"    {s}" for s in subjects)
            + "\n  To add them to the series: git -C "
            f"{rel(tree)} checkout {backup} && {refresh}"
        )


def series_of_ref(tree: Path, ref: str, series: Series) -> Series:
    """The series whose base `ref` is built on: `series` itself, or (for a
    detached HEAD on another release) that release's series if it has one."""
    base = series.base()
    if git_ok(tree, "merge-base", "--is-ancestor", base.tree_ref, ref):
        return series
    recorded = series_recorded_at(tree, ref)
    if recorded is not None:
        return recorded
    version = release_from_history(tree, ref)
    try:
        return series_for_version(version) if version else series
    except ForkError:
        return series


def conflict_error(tree: Path, series: Series, patches: list) -> ForkError:
    base = series.base()
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
        f"  3. {make_hint('refresh', tree, series)}   (writes the resolved "
        "series back)\n"
        f"  4. {make_hint('apply', tree, series)}   (adds the overlay)\n"
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
    # The digests `python -m vllm._fork` checks the files against.
    write_digests(tree, series, series_variable(series))
    # What the tree was built from, for the commands that follow (make
    # install, refresh, wheel... default to it: keep/tree_release.py).
    message = (
        f"{OVERLAY_SUBJECT} ({len(files)} files)\n\n"
        "Files the fork owns outright, laid over the patched tree, and the\n"
        f"digests of the files the series changes ({DIGESTS_FILE}).\n\n"
        f"{RELEASE_TRAILER}: {series.base().version}\n"
        f"{DIR_TRAILER}: {rel(series.dir)}\n"
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


def marker_series(marker: dict) -> Series | None:
    """The series an interrupted build was building, if it is still there."""
    series = marker.get("series")
    if not series or series == "?":
        return None
    path = Path(series)
    path = path if path.is_absolute() else ROOT / path
    return Series(path) if (path / "base.toml").is_file() else None


def marker_variable(marker: dict) -> str:
    """The make variable that names the series an interrupted build was
    building (VERSION=, or SERIES= for a directory of its own)."""
    building = marker_series(marker)
    if building is not None:
        return series_variable(building)
    release = marker.get("release")
    return f"VERSION={release}" if release and release != "?" else ""


def take_back_interrupted(tree: Path, series: Series | None, base: Base) -> bool:
    """If the last build of `tree` was cut short, undo its half-done work
    (or refuse, naming the changes it cannot account for), say so and
    return True."""
    marker = interrupted.read_marker(tree)
    if not marker:
        return False
    again = f"make apply {marker_variable(marker)}".strip()
    if tree.resolve() != DEFAULT_TREE.resolve():
        again += f" TREE={rel(tree)}"
    involved = [series] if series else []
    building = marker_series(marker)
    if building is not None:
        involved.append(building)
    overlay = series.overlay if series else OVERLAY
    interrupted.take_back(tree, involved, marker, overlay, again)
    say(
        f"{rel(tree)}/: the last `make apply` (building "
        f"{marker.get('release', '?')}) was interrupted at its "
        f"{marker.get('stage', '?')}; its half-done work is undone"
    )
    return True


def mark(tree: Path, series: Series | None, base: Base, stage: str) -> None:
    """Record what this run builds before it moves the tree (see
    keep/interrupted.py), with where HEAD was the first time."""
    fields: dict[str, str | None] = {"stage": stage}
    if not interrupted.read_marker(tree):
        fields.update(
            release=base.version,
            series=rel(series.dir) if series else None,
            old_head=git(tree, "rev-parse", "-q", "--verify", "HEAD", check=False)
            or None,
        )
    if git_ok(tree, "rev-parse", "-q", "--verify", base.tree_ref):
        fields["target"] = git(tree, "rev-parse", f"{base.tree_ref}^{{commit}}")
    interrupted.record(tree, **fields)


def say_interrupted(tree: Path, series: Series) -> None:
    say(
        f"{rel(tree)}/ is half-built; `{make_hint('apply', tree, series)}` "
        "finishes it (your work in the tree was not touched)"
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
    resumed = take_back_interrupted(tree, series, base)
    check_clean(tree, series)
    on_branch = git(tree, "symbolic-ref", "-q", "--short", "HEAD", check=False)
    # A tree made before the base moved to refs/remotes/ is rebuilt once.
    has_base = git_ok(tree, "rev-parse", "-q", "--verify", base.tree_ref)
    if on_branch == base.branch and head_fingerprint(tree) == fingerprint and has_base:
        if resumed:  # cut short between the overlay commit and the tag
            git(tree, "tag", "-f", f"v{base.version}", "HEAD")
        say(
            f"{rel(tree)}/ is up to date ({base.branch}, {len(patches)} patches, "
            f"series {fingerprint}); nothing to do"
        )
        return False
    try:
        build(tree, series, cache, source)
    except KeyboardInterrupt:
        say_interrupted(tree, series)
        raise
    return True


def build(tree: Path, series: Series, cache: Path, source: str | None) -> None:
    """apply_series' work, each step after the marker that covers it."""
    base, patches, fingerprint = series.base(), series.patches(), series.fingerprint()
    mark(tree, series, base, "fetch")
    fetch_base(tree, base, ensure_base(base, series.base_file, cache, source))

    keep_user_work(tree, base, series)
    step(
        f"building {rel(tree)}/ on branch {base.branch}: upstream vLLM "
        f"{base.version} + {len(patches)} patches + overlay"
    )
    mark(tree, series, base, "checkout")
    git(tree, "checkout", "-q", "-B", base.branch, base.tag)
    if patches:
        mark(tree, series, base, "git am")
        labels = apply_labels()  # the README's name of each fix, when not its number
        for i, p in enumerate(patches, 1):
            say(f"    [{i}/{len(patches)}] {p.name}{progress_label(p, labels)}")
        done = git_am(tree, [p.path for p in patches])
        if done.returncode < 0:  # killed by a signal: an interrupt, not a conflict
            raise KeyboardInterrupt
        if done.returncode != 0:
            # A real conflict: the tree is the user's to resolve from here.
            interrupted.clear(tree)
            raise conflict_error(tree, series, patches)
    mark(tree, series, base, "overlay commit")
    date = git(tree, "log", "-1", "--format=%ad", "--date=raw")
    lay_overlay(tree, series, fingerprint, date)
    # setuptools-scm takes the installed version from the nearest vX.Y.Z tag:
    # the patched tree installs as X.Y.Z (plus vLLM's +empty/+precompiled;
    # make install sets the fork's own label).
    git(tree, "tag", "-f", f"v{base.version}", "HEAD")
    interrupted.clear(tree)
    say(
        f"{rel(tree)}/ ready: {git(tree, 'rev-parse', '--short', 'HEAD')} "
        f"({base.branch}, series {fingerprint})"
    )


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
    take_back_interrupted(tree, None, base)
    check_clean(tree)
    if git(tree, "rev-parse", "HEAD", check=False) == git(
        tree, "rev-parse", f"{base.tag}^{{commit}}", check=False
    ):
        return
    mark(tree, None, base, "fetch")
    fetch_base(tree, base, ensure_base(base, base_file, cache))
    mark(tree, None, base, "checkout")
    git(tree, "checkout", "-q", "--detach", base.tag)
    interrupted.clear(tree)


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
    series, tree = series_from_arguments(args), args.tree.resolve()
    announce_choice(series, "building", tree)
    apply_series(series, tree, source=args.source)
    lag = stale_install(tree)
    if lag:
        say(lag)
    return 0


if __name__ == "__main__":
    main_guard(main)
