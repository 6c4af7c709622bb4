#!/usr/bin/env python3
"""Move a patch series onto another upstream release (`make rebase`).

  make rebase BASE=0.33.0                 a release, looked up on PyPI
  make rebase BASE=<ref> VERSION=0.34.0   a git ref of GIT_URL (default: the
                                          series' git_url)
  make rebase-continue                    after resolving a conflict
  make rebase-abort                       give up; everything as it was

The series moved is, unless SERIES= names one, the nearest existing series
on the way from the default one (patches/, on 0.20.2): for a newer release
the newest series below it, for an older one the oldest series above it. So
a release published after every series here follows from the newest one.

The new release is imported and checked out bare (.work/v<new>/base), each
patch's reproducers are run on it, and the series is replayed in the tree
(default vllm/, branch fork/v<new>), patch by patch. Every patch ends in
exactly one state:

  clean     applies to the new release as it is
  merged    applies with a three-way merge, a recorded resolution, or one
            you made by hand
  upstream  dropped: its reproducers all pass on the bare new release (the
            bug is fixed there, whatever the code), or its change is already
            there (reverse-applies, or the merge leaves nothing to commit)
  conflict  stops: the tree is left mid-`git am` for you to resolve

Conflicts are recorded with git rerere, and a hand resolution is also kept
whole, as a diff (a port). Both go to the resolution store beside INTO
(patches/resolutions/, shared by every release's series; see
scripts/keep/resolutions.py) and are seeded into the tree before the next
replay, so a conflict resolved once is resolved the same way next time. A
patch changed since it was ported for this release, whose hunks rerere
still resolves, stops anyway: carry over what else that port edited.

Nothing in INTO (default patches/v<new>/) or SERIES changes until every
patch is through; then INTO receives base.toml, the patches and REBASE.md
(the table: where each patch of the old series went, and the store entries
it used), the store the new resolutions (entries no series uses any more
are removed), and the tree is rebuilt from INTO as `make apply` would. The
rebase state is kept in the tree's .git directory (vllm-fork-rebase.json,
with a copy of the patches), so the series directory may change meanwhile.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.apply import (
    check_clean,
    checkout_release,
    fetch_base,
    init_tree,
    keep_user_work,
    make_hint,
)
from keep.fetch import ensure_base, resolve_git, resolve_release
from keep.rebase_finish import check_into, finish
from keep.rebase_replay import (
    CLEAN,
    CONFLICT,
    MERGED,
    PENDING,
    UPSTREAM,
    Outcome,
    am,
    am_in_progress,
    build_old_series,
    commit_resolution,
    head,
    replay_one,
    stale_adaptation,
    unmerged_files,
)
from keep.rebase_report import conflict_stop, edit_stop
from keep.rebase_state import (
    SNAPSHOT,
    Entry,
    State,
    cleanup,
    state_exists,
    state_file,
    store_for,
)
from keep.rebase_verdicts import drop_fixed_reproducers, run_verdicts, verdict_note
from keep.resolutions import (
    gitdir,
    note_path,
    record_port,
    seed_conflicts,
    seed_ports,
)
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import CACHE, DEFAULT_SERIES, DEFAULT_TREE, OVERLAY, ROOT, WORK, rel
from lib.proc import git, git_ok, run, tool_identity_env
from lib.series import BASE_FILE, Base, Series, find_series, read_base, version_key

# This module is the state machine and the CLI: start, advance, resume
# (make rebase-continue), abort. The parts it drives, one idea each:
# rebase_replay (one patch replayed and classified), rebase_verdicts (the
# reproducers on the bare release), rebase_state (the state kept in .git),
# rebase_report (the table, the stop messages, REBASE.md) and rebase_finish
# (the new series and the store written once every patch is through).

LOGS = WORK / "logs"
VERSION_RE = re.compile(r"v?(\d+\.\d+\.\d+(?:(?:\.post|\.dev|rc|a|b)\d+)*)")


def parse_base(spec: str, version: str | None, git_url: str | None, old: Base) -> Base:
    """BASE=<release> (PyPI) or BASE=<git ref> (with VERSION unless the ref
    is named after one, like v0.34.0)."""
    m = VERSION_RE.fullmatch(spec)
    if m and not git_url:
        if version and version != m.group(1):
            raise ForkError(
                f"BASE={spec} is release {m.group(1)}, not VERSION={version}"
            )
        return resolve_release(m.group(1))
    tail = spec.rsplit("/", 1)[-1]
    named = VERSION_RE.fullmatch(tail)
    version = version or (named.group(1) if named else None)
    if not version:
        raise ForkError(
            f"BASE={spec} is a git ref, not a release: say which version it is, "
            f"e.g. make rebase BASE={spec} VERSION=0.34.0.dev0"
        )
    return resolve_git(git_url or old.git_url, spec, version)


def start(
    series: Series,
    new: Base,
    into: Path,
    tree: Path = DEFAULT_TREE,
    cache: Path = CACHE,
    *,
    python: Path | None = None,
    repro_root: Path = ROOT,
    base_tree: Path | None = None,
    logs: Path = LOGS,
    edit: list[str] | None = None,
) -> State:
    """Start moving `series` onto `new`; runs until done, a conflict, or a
    patch named in `edit`."""
    old = series.base()
    patches = series.patches()
    unknown = [e for e in edit or [] if not any(to_edit(p.name, [e]) for p in patches)]
    if unknown:
        raise ForkError(
            f"EDIT={' '.join(unknown)} names no patch of {rel(series.dir)}/ "
            "(EDIT takes a patch's number or name in the series being moved: "
            + ", ".join(p.name[:4] for p in patches)
            + "). Nothing was changed."
        )
    init_tree(tree)
    check_clean(tree)
    check_into(into)
    if new.version == old.version:
        raise ForkError(f"{rel(series.dir)}/ is already on {old.version}")
    started = time.time()

    ensure_base(old, series.base_file, cache)
    new_repo = ensure_base(new, into / BASE_FILE, cache)
    base_tree = base_tree or WORK / f"v{new.version}" / "base"
    step(f"bare vLLM {new.version} in {rel(base_tree)}/")
    checkout_release(new, into / BASE_FILE, base_tree, cache)
    ids = [t for p in patches for t in p.reproducers()]
    verdicts = run_verdicts(ids, base_tree, new, python, repro_root, logs)

    # The old release's files are what `git am -3` merges from.
    fetch_base(tree, old, ensure_base(old, series.base_file, cache))
    fetch_base(tree, new, new_repo)
    keep_user_work(tree, new, series)
    orig_ref = git(tree, "symbolic-ref", "-q", "HEAD", check=False)
    orig_commit = git(tree, "rev-parse", "-q", "--verify", "HEAD", check=False)
    branch_before = git(
        tree, "rev-parse", "-q", "--verify", f"refs/heads/{new.branch}", check=False
    )
    snapshot = gitdir(tree) / SNAPSHOT
    shutil.rmtree(snapshot, ignore_errors=True)
    snapshot.mkdir()
    for p in patches:
        shutil.copyfile(p.path, snapshot / p.name)
    store = store_for(into)
    conflict_paths = seed_conflicts(tree, store, started - 60, new_repo)
    seeded = len(conflict_paths) + seed_ports(tree, store)
    try:
        build_old_series(tree, series)
    except ForkError:
        restore_head(tree, orig_ref, orig_commit)
        raise
    git(tree, "checkout", "-q", "-B", new.branch, new.tag)
    state = State(
        tree=str(tree),
        series=str(series.dir),
        into=str(into),
        overlay=str(series.overlay),
        cache=str(cache),
        old_base=asdict(old),
        new_base=asdict(new),
        orig_ref=orig_ref,
        orig_commit=orig_commit,
        branch_before=branch_before,
        verdicts=verdicts,
        patches=[Entry(p.name, p.subject(), p.reproducers()) for p in patches],
        started=started,
        conflict_paths=conflict_paths,
        edit=list(edit or []),
    )
    state.save()
    step(
        f"replaying {len(patches)} patches of {rel(series.dir)}/ on vLLM "
        f"{new.version} in {rel(tree)}/ (branch {new.branch}"
        + (f", {seeded} recorded resolutions" if seeded else "")
        + ")"
    )
    return advance(state, 0)


def advance(state: State, first: int) -> State:
    """Replay the patches from index `first` on; finish when all are through."""
    tree, new = state.tree_path, state.new
    total = len(state.patches)
    for i in range(first, total):
        entry = state.patches[i]
        outcome = replay_one(
            tree,
            state.patch_file(entry),
            entry.reproducers,
            state.verdicts,
            new.version,
        )
        record(state, entry, outcome)
        drop_fixed_reproducers(state, entry)
        say(f"    [{i + 1}/{total}] {entry.name}: {entry.state} ({entry.detail})")
        if outcome.state == CONFLICT:
            state.stopped_at = i
            state.stopped_head = head(tree)
            state.save()
            raise conflict_stop(state, entry)
        stale = (
            stale_adaptation(tree, state.patch_file(entry), new.version)
            if outcome.state in (CLEAN, MERGED) and not outcome.port
            else None
        )
        if outcome.state in (CLEAN, MERGED) and (
            to_edit(entry.name, state.edit) or stale
        ):
            # Applied, but the new release needs it changed (code it relies
            # on moved or grew a case; or a hand port made for this release
            # is not in what applied, the patch having changed since): stop
            # with it committed. The amended commit is taken in as a hand
            # resolution, a port, so that the next rebase replays it (see
            # `rebase_replay.adapted`).
            state.stopped_at = i
            state.stopped_head = git(tree, "rev-parse", "HEAD~1")
            state.edit_tip = head(tree)
            state.save()
            raise edit_stop(state, entry, stale)
        state.save()
    return finish(state)


def record(state: State, entry: Entry, outcome: Outcome) -> None:
    verdicts = state.verdicts
    entry.state = outcome.state
    entry.detail = outcome.detail
    if outcome.state != UPSTREAM or "reproducer" not in outcome.detail:
        entry.detail += verdict_note(entry.reproducers, verdicts)
    entry.files = outcome.files
    entry.conflict_ids = sorted(set(entry.conflict_ids) | set(outcome.conflicts))
    state.conflict_paths.update(outcome.conflicts)
    for conflict_id, path in outcome.conflicts.items():
        note_path(state.tree_path, conflict_id, path)
    entry.port = outcome.port


def to_edit(name: str, edit: list[str]) -> bool:
    """Whether EDIT= names this patch (its number, as in 0005, or its name)."""
    return any(name == e or name.startswith(e.zfill(4) + "-") for e in edit)


def resume(tree: Path = DEFAULT_TREE) -> State:
    """`make rebase-continue`: take in the resolution, go on with the rest."""
    state = State.load(tree)
    new = state.new
    if state.stopped_at < 0:
        pending = [i for i, e in enumerate(state.patches) if e.state == PENDING]
        if not pending:
            return finish(state)  # stopped before writing INTO: try again
        # Interrupted between or inside patches (Ctrl-C): a half-done am of
        # the tool's own is undone and that patch replayed.
        if am_in_progress(tree):
            am(tree, "--abort")
        say(f"    resuming with {state.patches[pending[0]].name}")
        return advance(state, pending[0])
    entry = state.patches[state.stopped_at]
    t = rel(tree)
    if am_in_progress(tree):
        left = unmerged_files(tree)
        if left:
            raise ForkError(
                f"{entry.name} still has unresolved files:\n"
                + "".join(f"  {t}/{f}\n" for f in left)
                + f"Resolve them, `git -C {t} add` them, then "
                + make_hint("rebase-continue", tree)
            )
        markers = [
            line
            for line in git(
                tree, "diff", "--cached", "--check", check=False
            ).splitlines()
            if "conflict marker" in line
        ]
        if markers:
            raise ForkError(
                f"{entry.name}: conflict markers are still staged:\n"
                + "\n".join(f"  {t}/{m}" for m in markers)
                + f"\nRemove them, `git -C {t} add` the files, then "
                + make_hint("rebase-continue", tree)
            )
        port = record_port(
            tree, state.patch_file(entry), state.stopped_head, new.tree_ref
        )
        outcome = commit_resolution(
            tree, state.stopped_head, "resolved by hand", new.version, port
        )
    elif state.edit_tip and head(tree) == state.edit_tip:
        # Stopped by EDIT= and continued without a change: nothing to record.
        say(f"    {entry.name}: not changed after the EDIT= stop; kept as it applied")
        state.stopped_at, state.edit_tip = -1, ""
        state.save()
        return advance(state, state.patches.index(entry) + 1)
    elif state.edit_tip and git(tree, "rev-parse", "HEAD~1") != state.stopped_head:
        raise ForkError(
            f"{entry.name}: amend its commit (git -C {t} commit -a --amend "
            f"--no-edit); HEAD~1 is not the commit before it any more. Then "
            + make_hint("rebase-continue", tree)
        )
    elif head(tree) != state.stopped_head:
        # The user finished the `git am` themselves, or amended a patch that
        # EDIT= stopped after.
        run(["git", "-C", tree, "rerere"], check=False)
        port = record_port(
            tree, state.patch_file(entry), state.stopped_head, new.tree_ref, "HEAD"
        )
        how = "resolved by hand" if entry.state == CONFLICT else "adapted by hand"
        outcome = Outcome(MERGED, how, port=port)
    else:
        say(
            f"warning: the `git am` of {entry.name} was aborted or skipped by hand; "
            "replaying it again (to drop a patch, resolve it to the new release's "
            "code)"
        )
        state.stopped_at = -1
        state.save()
        return advance(state, state.patches.index(entry))
    record(state, entry, outcome)
    drop_fixed_reproducers(state, entry)
    say(
        f"    [{state.stopped_at + 1}/{len(state.patches)}] {entry.name}: {entry.state}"
    )
    first = state.stopped_at + 1
    state.stopped_at, state.edit_tip = -1, ""
    state.save()
    return advance(state, first)


def abort(tree: Path = DEFAULT_TREE) -> None:
    """`make rebase-abort`: the tree as it was before; nothing else changed."""
    state = State.load(tree)
    t = rel(tree)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup = f"backup/rebase-v{state.new.version}-{stamp}"
    if am_in_progress(tree):
        run(["git", "-C", tree, "rerere"], check=False)
        work = unsaved_resolution(tree)
        if work:
            git(tree, "branch", backup, work)
            say(f"    your unfinished resolution is kept on branch {backup}")
        am(tree, "--abort")
    by_hand = [e.name for e in state.patches if "by hand" in e.detail]
    if by_hand:
        name = backup + "-resolved"
        git(tree, "branch", name, "HEAD")
        say(f"    the patches you resolved ({', '.join(by_hand)}) are kept on {name}")
    restore_head(tree, state.orig_ref, state.orig_commit)
    branch = f"refs/heads/{state.new.branch}"
    if state.orig_ref == branch:
        git(tree, "reset", "-q", "--hard", state.orig_commit)
    elif state.branch_before:
        git(tree, "update-ref", branch, state.branch_before)
    elif git_ok(tree, "rev-parse", "-q", "--verify", branch):
        git(tree, "update-ref", "-d", branch)
    state_file(tree).unlink()
    cleanup(tree)
    say(
        f"rebase onto {state.new.version} aborted: {t}/ is back on "
        f"{state.orig_ref.removeprefix('refs/heads/') or state.orig_commit[:12]}; "
        f"{rel(Path(state.series))}/ and {rel(Path(state.into))}/ were not changed. "
        "Recorded resolutions stay in the tree for the next try."
    )


def restore_head(tree: Path, ref: str, commit: str) -> None:
    """Check out what was checked out: a branch, or a detached commit."""
    if ref:
        git(tree, "checkout", "-q", "-f", ref.removeprefix("refs/heads/"))
    elif commit:
        git(tree, "checkout", "-q", "-f", "--detach", commit)


def unsaved_resolution(tree: Path) -> str | None:
    """A commit of the work tree as it is now (edits in progress during a
    conflict), made without touching the index; None if nothing changed."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**tool_identity_env(), "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        run(["git", "-C", tree, "read-tree", "HEAD"], env=env)
        run(["git", "-C", tree, "add", "-A"], env=env)
        tree_id = run(["git", "-C", tree, "write-tree"], env=env).stdout.strip()
    if tree_id == git(tree, "rev-parse", "HEAD^{tree}"):
        return None
    return git(
        tree,
        "commit-tree",
        tree_id,
        "-p",
        "HEAD",
        "-m",
        "rebase: unfinished conflict resolution (kept by make rebase-abort)",
        env=tool_identity_env(),
    )


def main() -> int:
    p = parser(__doc__, tree="checkout to replay in")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--base", help="the new release (0.33.0) or a git ref")
    what.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="go on after resolving a conflict",
    )
    what.add_argument(
        "--abort", action="store_true", help="undo the rebase in progress"
    )
    p.add_argument("--version", help="the version a git ref stands for")
    p.add_argument(
        "--edit",
        action="append",
        default=[],
        metavar="PATCH",
        help="stop after this patch (number or name) even if it applies, to "
        "adapt it to the new release; repeatable (make rebase EDIT=0005)",
    )
    p.add_argument("--git-url", help="repository of a git ref (default: the series')")
    p.add_argument(
        "--series",
        type=Path,
        help="series to move (default: the nearest one, see above)",
    )
    p.add_argument(
        "--into",
        type=Path,
        help="where the new series goes (default: patches/v<new version>/)",
    )
    args = p.parse_args()
    tree = args.tree.resolve()
    if args.resume:
        resume(tree)
    elif args.abort:
        abort(tree)
    else:
        if state_exists(tree):
            state = State.load(tree)
            raise ForkError(
                f"a rebase onto {state.new.version} is in progress in {rel(tree)}/: "
                f"{make_hint('rebase-continue', tree)}, or "
                f"{make_hint('rebase-abort', tree)}"
            )
        release = VERSION_RE.fullmatch(args.base)
        pinned = None
        if release and not args.git_url:
            # A release INTO already pins is taken from there, not PyPI.
            into = (args.into or DEFAULT_SERIES / f"v{release.group(1)}").resolve()
            if (into / BASE_FILE).is_file():
                pinned = read_base(into / BASE_FILE)
                if pinned.version != release.group(1):
                    pinned = None
        default = Series(DEFAULT_SERIES, overlay=OVERLAY)
        new = pinned or parse_base(
            args.base, args.version, args.git_url, default.base()
        )
        if args.series:
            series = Series(args.series.resolve(), overlay=OVERLAY)
        else:
            series = nearest_series(new.version)
            step(
                f"moving the nearest series, {rel(series.dir)}/ "
                f"(vLLM {series.base().version}), onto {new.version}"
            )
        into = (args.into or DEFAULT_SERIES / f"v{new.version}").resolve()
        start(series, new, into, tree, edit=args.edit)
    return 0


def nearest_series(version: str) -> Series:
    """The series to move onto `version`: the nearest one on the way from
    the default series, so that every release's series descends from
    patches/ through its neighbours (the newest series below a newer
    release, the oldest above an older one)."""
    default = Series(DEFAULT_SERIES, overlay=OVERLAY)
    home, target = version_key(default.base().version), version_key(version)
    keyed = [(version_key(s.base().version), s) for s in find_series()]
    if target > home:
        below = [(k, s) for k, s in keyed if home <= k < target]
        return max(below, key=lambda ks: ks[0])[1] if below else default
    above = [(k, s) for k, s in keyed if target < k <= home]
    return min(above, key=lambda ks: ks[0])[1] if above else default


if __name__ == "__main__":
    main_guard(main)
