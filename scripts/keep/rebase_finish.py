"""The end of a rebase, once every patch is through: the new series
written into INTO, only after the tree has been rebuilt from it as `make
apply` would; the resolutions the rebase recorded or replayed saved in the
store, and the entries no series uses any more pruned from it. Also the
check, made at the start too, that INTO has no uncommitted changes.

Separate from the state machine (rebase.py): this is the one part of a
rebase that writes into the project (INTO and the store); everything
before it stays in the tree and its .git directory.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from keep.apply import apply_series, make_hint
from keep.fetch import upstream_repo
from keep.fix_ids import rebase_notes
from keep.rebase_replay import CLEAN, CONFLICT, MERGED, PENDING, head
from keep.rebase_report import REPORT, report, table
from keep.rebase_state import State, cleanup, state_file
from keep.refresh import format_patches
from keep.resolutions import prune, save_conflict, save_port, used_conflicts
from lib.cli import say
from lib.errors import ForkError
from lib.paths import rel
from lib.proc import git, run
from lib.series import BASE_FILE, Series, find_series


def into_changes(into: Path) -> list[str]:
    """Uncommitted changes under `into` in the project's git repository."""
    if not into.exists():
        return []
    proc = run(
        [
            "git",
            "-C",
            into,
            "status",
            "--porcelain",
            "--untracked-files=all",
            "--",
            ".",
        ],
        check=False,
    )
    return proc.stdout.splitlines() if proc.returncode == 0 else []


def check_into(into: Path) -> None:
    changes = into_changes(into)
    if changes:
        shown = "\n".join(f"  {c}" for c in changes[:10])
        raise ForkError(
            f"{rel(into)}/ has uncommitted changes, which the rebase would "
            f"overwrite:\n{shown}\nCommit or discard them first. Nothing was changed."
        )


def save_resolutions(state: State) -> list[str]:
    """Keep in the store what this rebase recorded or replayed: each
    conflict's resolution and each port. Returns the store's entries."""
    tree, store = state.tree_path, state.store
    cache_repo = upstream_repo(Path(state.cache))
    saved = [
        save_conflict(
            tree,
            store,
            conflict_id,
            n,
            state.conflict_paths.get(conflict_id, ""),
            state.new.tree_ref,
            cache_repo,
        )
        for conflict_id, n in used_conflicts(tree, state.started)
    ]
    saved += [save_port(tree, e.port, store) for e in state.patches if e.port]
    return sorted(set(saved))


def series_dirs(root: Path) -> list[Path]:
    """The series under `root` (root itself and its v<release>/ dirs)."""
    return [d for d in [root, *sorted(root.iterdir())] if (d / BASE_FILE).is_file()]


def finish(state: State) -> State:
    """Every patch is through: write INTO, rebuild the tree from it."""
    tree, new = state.tree_path, state.new
    into = Path(state.into)
    check_into(into)
    unsettled = [e.name for e in state.patches if e.state in (PENDING, CONFLICT)]
    if unsettled:  # never write a series that silently lacks a patch
        raise ForkError(f"patches not through yet: {', '.join(unsettled)}")
    kept = [e for e in state.patches if e.state in (CLEAN, MERGED)]
    commits = git(tree, "rev-list", "--reverse", f"{new.tag}..HEAD").split()
    if len(commits) != len(kept):
        raise ForkError(
            f"{rel(tree)}/ has {len(commits)} commits on {new.tag}, but "
            f"{len(kept)} patches were kept: was something committed by hand? "
            f"{make_hint('rebase-abort', tree)} and start again"
        )
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "series"
        staging.mkdir()
        (staging / BASE_FILE).write_text(new.to_toml())
        for entry, path in zip(
            kept, format_patches(tree, commits, staging), strict=True
        ):
            entry.new_name = path.name
        saved = save_resolutions(state)
        (staging / REPORT).write_text(report(state, saved))
        result = head(tree)
        # Rebuild as `make apply` does from what will be in INTO: proves the
        # written series applies, and adds the overlay and the version tag.
        state_file(tree).unlink()
        staged_series = Series(staging, overlay=Path(state.overlay))
        try:
            apply_series(staged_series, tree, Path(state.cache))
        except ForkError as e:
            state.save()
            raise ForkError(
                f"the rebased series does not rebuild in {rel(tree)}/: {e}\n"
                f"The rebased commits are at {result}; nothing was written to "
                f"{rel(into)}/."
            ) from e
        write_series(staging, into)
    note_fix_ids(into)
    prune(state.store, series_dirs(state.store.parent))
    cleanup(tree)
    minutes = (time.time() - state.started) / 60
    say("")
    say(table(state.patches))
    say(
        f"\n{rel(into)}/ now holds the series on vLLM {new.version}: {len(kept)} of "
        f"{len(state.patches)} patches ({minutes:.1f} min). {rel(tree)}/ is on "
        f"{new.branch}.\nReview with `git diff -- {rel(into)}`, test with "
        f"`make test`, and commit {rel(into)}/."
    )
    return state


def note_fix_ids(into: Path) -> None:
    """The fix column of INTO's REBASE.md, when INTO is one of the project's
    series (the ids are counted over all of them). Where that cannot be
    done, `fix_ids.py --write-rebase-notes` does it later, and
    tests/tooling/test_rebase_notes.py says so."""
    all_series = find_series()
    if any(s.dir.resolve() == into.resolve() for s in all_series):
        try:
            rebase_notes(all_series, write=True, only=into)
        except ForkError as e:
            say(f"{rel(into)}/REBASE.md: no fix ids written: {e}")


def write_series(staging: Path, into: Path) -> None:
    """Replace the series files in `into` (other files, like a series for
    another release in a subdirectory, are left alone)."""
    into.mkdir(parents=True, exist_ok=True)
    for old in Series(into).patches():
        old.path.unlink()
    for f in sorted(staging.iterdir()):
        if f.is_dir():
            shutil.copytree(f, into / f.name)
        else:
            shutil.copyfile(f, into / f.name)
