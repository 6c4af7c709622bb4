"""The reproducers of the series being moved, on the bare new release.

`run_verdicts` runs every reproducer the patches name on the new release,
unpatched (as [state, message] per test); a patch whose reproducers all
pass there is dropped as upstream (`rebase_replay.reproducers_pass`).
`verdict_note` names those that could not say anything, and
`drop_fixed_reproducers` takes out of a kept patch's trailers those that
pass or skip there. Separate from the replay: what the tests say about a
release, not how a patch applies to it.
"""

from __future__ import annotations

from pathlib import Path

from keep.rebase_replay import CLEAN, MERGED, committer_env
from keep.rebase_state import Entry, State
from lib.cli import step
from lib.proc import git, run
from lib.series import Base
from lib.testenv import Verdict, reproducer_verdicts


def run_verdicts(
    ids: list[str],
    base_tree: Path,
    new: Base,
    python: Path | None,
    repro_root: Path,
    logs: Path,
) -> dict[str, list[str]]:
    """Each reproducer on the bare new release, as [state, message]."""
    if not ids:
        return {}
    if python is None:
        from lib.venv import release_venv

        python = release_venv(new.version, base_tree / "requirements" / "common.txt")
    step(f"running {len(ids)} reproducer tests on bare vLLM {new.version}")
    stem = f"rebase-v{new.version}-reproducers"
    logs.mkdir(parents=True, exist_ok=True)
    verdicts: dict[str, Verdict] = reproducer_verdicts(
        python, base_tree, ids, repro_root, logs / f"{stem}.xml", logs / f"{stem}.log"
    )
    return {t: [v.state, v.message] for t, v in verdicts.items()}


def verdict_note(ids: list[str], verdicts: dict) -> str:
    """Reproducers that could not say anything on the new release."""
    odd = [
        f"{t.split('::')[-1]} {verdicts[t][0]} ({verdicts[t][1]})"
        for t in ids
        if t in verdicts and verdicts[t][0] not in ("passes", "fails")
    ]
    return "; reproducer " + "; ".join(odd) if odd else ""


def shows_nothing_there(verdict: list[str]) -> bool:
    """A reproducer verdict that cannot show the bug on that release: the
    test passes there (upstream fixed that part), or skips itself (what it
    sets up does not happen there)."""
    state, message = (verdict + ["", ""])[:2]
    return state == "passes" or (state == "not run" and message.startswith("skipped"))


def drop_fixed_reproducers(state: State, entry: Entry) -> None:
    """A kept patch's reproducers that pass on the bare new release no longer
    show its bug there (upstream fixed that part), and those that skip there
    never can: take their trailers out of the patch's commit, so that the
    new series names only tests that fail on its base."""
    if entry.state not in (CLEAN, MERGED):
        return
    fixed = {
        t
        for t in entry.reproducers
        if shows_nothing_there(list(state.verdicts.get(t, [""])))
    }
    if not fixed or fixed == set(entry.reproducers):
        return
    tree = state.tree_path
    message = git(tree, "log", "-1", "--format=%B")
    kept = [
        line
        for line in message.splitlines()
        if not (
            line.startswith("Reproducer:")
            and line.removeprefix("Reproducer:").strip() in fixed
        )
    ]
    run(
        [
            *("git", "-C", tree, "commit", "-q", "--amend", "--cleanup=whitespace"),
            *("-m", "\n".join(kept) + "\n"),
        ],
        env=committer_env(),
    )
    entry.detail += (
        f"; {len(fixed)} of its reproducers pass or skip on {state.new.version}: "
        "dropped from its trailers"
    )
