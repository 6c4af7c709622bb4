"""The state of a rebase in progress, kept in the tree's .git directory.

`State` (saved as vllm-fork-rebase.json) with an `Entry` per patch of the
series being moved; the copy of those patches (SNAPSHOT) it replays from;
where the resolution store beside INTO is (`store_for`); and `cleanup` of
what a rebase leaves in .git. Separate from rebase.py so that the parts it
drives (the verdicts, the reports, the finish) read and update a rebase's
state without importing the state machine that imports them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from keep.apply import REBASE_STATE
from keep.rebase_replay import OLD_SERIES_REF, PENDING
from keep.resolutions import gitdir
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, rel
from lib.proc import git, git_ok
from lib.series import Base

SNAPSHOT = "vllm-fork-rebase"  # in the tree's .git: the patches being replayed
RESOLUTIONS = "resolutions"


@dataclass
class Entry:
    """One patch of the series being moved, and where it stands."""

    name: str
    subject: str
    reproducers: list[str]
    state: str = PENDING
    detail: str = ""
    files: list[str] = field(default_factory=list)
    conflict_ids: list[str] = field(default_factory=list)
    new_name: str = ""
    port: str = ""


@dataclass
class State:
    """A rebase in progress, as saved in <tree>/.git/vllm-fork-rebase.json."""

    tree: str
    series: str
    into: str
    overlay: str
    cache: str
    old_base: dict
    new_base: dict
    orig_ref: str  # the branch checked out before, or "" if detached
    orig_commit: str
    branch_before: str  # fork/v<new> before the rebase, "" if there was none
    verdicts: dict[str, list[str]]  # reproducer id -> [state, message]
    patches: list[Entry]
    stopped_at: int = -1
    stopped_head: str = ""
    started: float = 0.0
    # rerere's conflict ids and the files they are in: what the store keeps
    # of each resolution (see resolutions.py).
    conflict_paths: dict[str, str] = field(default_factory=dict)
    # Patches (by number or name) to stop after, to adapt them to the new
    # release although they apply: EDIT= (see `rebase.advance`).
    edit: list[str] = field(default_factory=list)
    # The patch's commit where EDIT= stopped, to tell an amended one.
    edit_tip: str = ""

    @property
    def store(self) -> Path:
        return store_for(Path(self.into))

    @property
    def new(self) -> Base:
        return Base(**self.new_base)

    @property
    def old(self) -> Base:
        return Base(**self.old_base)

    @property
    def tree_path(self) -> Path:
        return Path(self.tree)

    def patch_file(self, entry: Entry) -> Path:
        return gitdir(self.tree_path) / SNAPSHOT / entry.name

    def save(self) -> None:
        state_file(self.tree_path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, tree: Path) -> State:
        path = state_file(tree)
        if not path.is_file():
            raise ForkError(
                f"no rebase is in progress in {rel(tree)}/ "
                f"(no {rel(path)}); start one with make rebase BASE=<release>"
            )
        data = json.loads(path.read_text())
        data["patches"] = [Entry(**e) for e in data["patches"]]
        return cls(**data)


def store_for(into: Path) -> Path:
    """The resolution store shared by the series beside `into`
    (patches/resolutions/ for patches/v<release>/, and for patches/ itself
    when the default series is moved in place)."""
    if into.resolve() == DEFAULT_SERIES.resolve():
        return into / RESOLUTIONS
    return into.parent / RESOLUTIONS


def state_file(tree: Path) -> Path:
    return gitdir(tree) / REBASE_STATE


def state_exists(tree: Path) -> bool:
    return (tree / ".git").exists() and state_file(tree).exists()


def cleanup(tree: Path) -> None:
    shutil.rmtree(gitdir(tree) / SNAPSHOT, ignore_errors=True)
    if git_ok(tree, "rev-parse", "-q", "--verify", OLD_SERIES_REF):
        git(tree, "update-ref", "-d", OLD_SERIES_REF)
