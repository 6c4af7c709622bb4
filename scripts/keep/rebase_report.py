"""What a rebase says: the table of the patches and their states, the
message of a stop (a conflict, or a patch EDIT= names), and REBASE.md, the
report written into INTO beside the new series.

Separate from the state machine (rebase.py) and the finish
(rebase_finish.py): text only, made from a `State`, with nothing run or
written.
"""

from __future__ import annotations

import re
from pathlib import Path

from keep.apply import make_hint
from keep.rebase_replay import CONFLICT
from keep.rebase_state import Entry, State
from keep.resolutions import PORT_DIFF, USED_LINE
from lib.errors import ForkError
from lib.paths import rel
from lib.series import Base

REPORT = "REBASE.md"


def table(entries: list[Entry]) -> str:
    width = max([len(e.name) for e in entries] + [5])
    lines = [
        f"{'patch':<{width}}  {'state':<9}  detail",
        f"{'-' * width}  ---------  ------",
    ]
    for e in entries:
        detail = e.detail + (f" -> {e.new_name}" if e.new_name else "")
        if e.state == CONFLICT:
            detail += ": " + ", ".join(e.files)
        lines.append(f"{e.name:<{width}}  {e.state:<9}  {detail}")
    return "\n".join(lines)


def edit_stop(state: State, entry: Entry, stale: Path | None = None) -> ForkError:
    t = rel(state.tree_path)
    why = (
        f"applied, but the hand port recorded for it on these files "
        f"({stale / PORT_DIFF}) is not in what applied: the patch changed "
        "since it was ported. Carry that port's edits over"
        if stale is not None
        else "as EDIT= asked"
    )
    return ForkError(
        f"stopped after {entry.name}, {why}: it is committed on "
        f"{state.new.branch} in {t}/. Adapt it to vLLM {state.new.version}:\n"
        f"  1. edit the files, then git -C {t} commit -a --amend --no-edit\n"
        f"  2. {make_hint('rebase-continue', state.tree_path)}\n"
        "     (records the adapted patch, so that the next rebase replays it)\n"
        f"Or give up with: {make_hint('rebase-abort', state.tree_path)}"
    )


def conflict_stop(state: State, entry: Entry) -> ForkError:
    t = rel(state.tree_path)
    i = state.patches.index(entry)
    return ForkError(
        f"patch {entry.name} ({i + 1} of {len(state.patches)}) conflicts with "
        f"vLLM {state.new.version}.\n"
        + table(state.patches)
        + "\nConflicting files:\n"
        + "".join(f"  {t}/{f}\n" for f in entry.files)
        + f"{t}/ is left mid-`git am` on branch {state.new.branch}. To go on:\n"
        f"  1. edit the files (git -C {t} diff shows the conflicts), then\n"
        f"     git -C {t} add <files>\n"
        f"  2. {make_hint('rebase-continue', state.tree_path)}\n"
        "     (records your resolution, so that the next rebase replays it, and\n"
        "     goes on with the next patch)\n"
        "  If the new release already does what the patch did, resolve to its\n"
        "  code: the patch is then dropped as upstream.\n"
        f"Or give up with: {make_hint('rebase-abort', state.tree_path)}   "
        "(the tree back as it was; "
        f"{rel(Path(state.series))}/ and {rel(Path(state.into))}/ were not touched)"
    )


def base_arg(base: Base) -> str:
    """What BASE= named this release."""
    if base.source == "sdist":
        return base.version
    return f"{base.git_ref} VERSION={base.version}"


def report(state: State, saved: list[str]) -> str:
    old, new = state.old, state.new
    lines = [
        f"# vLLM {old.version} -> {new.version}",
        "",
        f"Written by `make rebase BASE={base_arg(new)}` from the "
        f"{old.version} series ({rel(Path(state.series))}/). Each patch of that "
        "series and where it went:",
        "",
        "| patch | state | detail | now |",
        "| --- | --- | --- | --- |",
    ]
    for e in state.patches:
        # The same words whether the resolution was made now or replayed, so
        # that rebasing again with nothing new rewrites the same report.
        detail = re.sub(
            r"^(resolved by hand|recorded resolution)",
            "conflict resolved (recorded)",
            re.sub(
                r"^(adapted by hand|recorded adaptation)",
                "adapted (recorded)",
                e.detail,
            ),
        )
        lines.append(
            f"| {e.name} | {e.state} | {detail.replace('|', '/')} | "
            f"{e.new_name or 'dropped'} |"
        )
    lines += ["", "Reproducers on the bare release:", ""]
    lines += ["| reproducer | on " + new.version + " |", "| --- | --- |"]
    for test_id, (verdict, message) in sorted(state.verdicts.items()):
        # Why a reproducer fails varies from run to run (hypothesis); why one
        # could not run at all is what a reader needs.
        shown = message if verdict not in ("passes", "fails") else ""
        note = f" ({shown.replace('|', '/')})" if shown else ""
        lines.append(f"| {test_id} | {verdict}{note} |")
    if saved:
        lines += ["", USED_LINE + ", ".join(saved)]
    return "\n".join(lines) + "\n"
