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
scripts/resolutions.py) and are seeded into the tree before the next
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

import json
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from resolutions import (
    PORT_DIFF,
    USED_LINE,
    apply_port,
    gitdir,
    has_port,
    merge_rr,
    note_path,
    patch_paths,
    prune,
    record_port,
    save_conflict,
    save_port,
    seed_conflicts,
    seed_ports,
    stale_port,
    used_conflicts,
)

from apply import (
    REBASE_STATE,
    apply_series,
    check_clean,
    checkout_release,
    fetch_base,
    git_am,
    init_tree,
    keep_user_work,
    make_hint,
)
from common import (
    CACHE,
    DEFAULT_SERIES,
    DEFAULT_TREE,
    OVERLAY,
    ROOT,
    WORK,
    ForkError,
    git,
    git_ok,
    main_guard,
    parser,
    rel,
    run,
    say,
    step,
    tool_identity_env,
)
from fetch import ensure_base, resolve_git, resolve_release, upstream_repo
from refresh import format_patches
from series import BASE_FILE, Base, Series, find_series, read_base, version_key
from testenv import Verdict, reproducer_verdicts

CLEAN, MERGED, UPSTREAM, CONFLICT, PENDING = (
    "clean",
    "merged",
    "upstream",
    "conflict",
    "pending",
)
OLD_SERIES_REF = "refs/vllm-fork/old-series"
SNAPSHOT = "vllm-fork-rebase"  # in the tree's .git: the patches being replayed
RESOLUTIONS = "resolutions"
REPORT = "REBASE.md"
LOGS = WORK / "logs"
VERSION_RE = re.compile(r"v?(\d+\.\d+\.\d+(?:(?:\.post|\.dev|rc|a|b)\d+)*)")


@dataclass
class Outcome:
    """What happened to one patch."""

    state: str
    detail: str
    files: list[str] = field(default_factory=list)
    conflicts: dict[str, str] = field(default_factory=dict)  # rerere id -> path
    port: str = ""


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
    # release although they apply: EDIT= (see `advance`).
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


def head(tree: Path) -> str:
    return git(tree, "rev-parse", "HEAD")


# --- one patch ----------------------------------------------------------------


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
    EDIT=, see `advance`) replaces what it applied: the commit is amended to
    the port. None if no port is recorded for it on these files."""
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


def verdict_note(ids: list[str], verdicts: dict) -> str:
    """Reproducers that could not say anything on the new release."""
    odd = [
        f"{t.split('::')[-1]} {verdicts[t][0]} ({verdicts[t][1]})"
        for t in ids
        if t in verdicts and verdicts[t][0] not in ("passes", "fails")
    ]
    return "; reproducer " + "; ".join(odd) if odd else ""


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


# --- the whole series ---------------------------------------------------------


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
        from venv import release_venv

        python = release_venv(new.version, base_tree / "requirements" / "common.txt")
    step(f"running {len(ids)} reproducer tests on bare vLLM {new.version}")
    stem = f"rebase-v{new.version}-reproducers"
    logs.mkdir(parents=True, exist_ok=True)
    verdicts: dict[str, Verdict] = reproducer_verdicts(
        python, base_tree, ids, repro_root, logs / f"{stem}.xml", logs / f"{stem}.log"
    )
    return {t: [v.state, v.message] for t, v in verdicts.items()}


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
            # `adapted`).
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


def to_edit(name: str, edit: list[str]) -> bool:
    """Whether EDIT= names this patch (its number, as in 0005, or its name)."""
    return any(name == e or name.startswith(e.zfill(4) + "-") for e in edit)


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


def cleanup(tree: Path) -> None:
    shutil.rmtree(gitdir(tree) / SNAPSHOT, ignore_errors=True)
    if git_ok(tree, "rev-parse", "-q", "--verify", OLD_SERIES_REF):
        git(tree, "update-ref", "-d", OLD_SERIES_REF)


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


# --- output -------------------------------------------------------------------


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


def main() -> int:
    p = parser(__doc__)
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
    p.add_argument(
        "--tree",
        type=Path,
        default=DEFAULT_TREE,
        help="checkout to replay in (default: vllm/)",
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


def state_exists(tree: Path) -> bool:
    return (tree / ".git").exists() and state_file(tree).exists()


if __name__ == "__main__":
    main_guard(main)
