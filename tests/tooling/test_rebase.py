"""rebase: every patch classified, conflicts resumable, nothing lost.

A synthetic upstream 9.9.9 with a series of five patches, one for each way a
patch can end, and a release 9.9.10 that:
- leaves the code of patch 1 alone                     -> clean
- changes a line two lines from patch 2's change        -> merged (3-way)
- fixes patch 3's bug with other code than the patch    -> upstream (reproducer)
- ships the file patch 4 adds, identical                -> upstream (change there)
- changes the very line patch 5 changes                 -> conflict
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import LINES, NEW_RELEASE, REPRODUCER, UPSTREAM_FILES, Upstream, git

from keep import rebase, rebase_replay, rebase_state
from keep.apply import apply_series
from lib.errors import ForkError
from lib.series import Series

CONFLICT_RE = re.compile(r"^<<<<<<< .*?^>>>>>>> [^\n]*\n", re.M | re.S)


def start(
    up: Upstream,
    project: Path,
    tree: Path | None = None,
    into=None,
    edit: list[str] | None = None,
):
    tmp = up.tree.parent
    return rebase.start(
        up.series,
        up.release("9.9.10", NEW_RELEASE),
        into or tmp / "into",
        tree or up.tree,
        up.cache,
        python=Path(sys.executable),
        repro_root=project,
        base_tree=tmp / "base-9.9.10",
        logs=tmp / "logs",
        edit=edit,
    )


def snapshot(d: Path) -> dict[str, bytes]:
    if not d.exists():
        return {}
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def states(tree: Path) -> list[tuple[str, str]]:
    state = rebase_state.State.load(tree)
    return [(e.name[:4], e.state) for e in state.patches]


def resolve_by_hand(tree: Path, resolution: str = "line twenty\n") -> None:
    """Replace the conflict in block_pool.py by `resolution`, and stage it."""
    path = tree / "vllm/v1/core/block_pool.py"
    text, n = CONFLICT_RE.subn(resolution, path.read_text())
    assert n == 1, text
    path.write_text(text)
    git(tree, "add", "vllm/v1/core/block_pool.py")


def test_every_patch_is_classified_and_the_conflict_resumes(five, project, capsys):
    series_before = snapshot(five.series.dir)
    with pytest.raises(ForkError) as info:
        start(five, project)
    msg = str(info.value)
    assert "0005-Conflict-change-line-20.patch (5 of 5)" in msg
    assert "vllm/v1/core/block_pool.py" in msg
    assert "make rebase-continue" in msg and "make rebase-abort" in msg
    assert states(five.tree) == [
        ("0001", "clean"),
        ("0002", "merged"),
        ("0003", "upstream"),
        ("0004", "upstream"),
        ("0005", "conflict"),
    ]
    # Stopped: nothing written, the series as it was, the tree resolvable.
    into = five.tree.parent / "into"
    assert not into.exists()
    assert snapshot(five.series.dir) == series_before
    conflicted = (five.tree / "vllm/v1/core/block_pool.py").read_text()
    assert "<<<<<<<" in conflicted
    # make apply refuses to touch a tree in the middle of a rebase.
    with pytest.raises(ForkError, match="middle of `make rebase` onto 9.9.10"):
        apply_series(five.series, five.tree, five.cache)

    resolve_by_hand(five.tree)
    state = rebase.resume(five.tree)
    final = {e.name: (e.state, e.detail, e.new_name) for e in state.patches}
    assert final["0003-Fix-popleft_n-raises-ValueError.patch"][:2] == (
        "upstream",
        "fixed in 9.9.10: its 1 reproducer(s) pass there",
    )
    assert final["0004-Add-new.py.patch"][0] == "upstream"
    assert "reverse-applies" in final["0004-Add-new.py.patch"][1]
    assert final["0005-Conflict-change-line-20.patch"] == (
        "merged",
        "resolved by hand",
        "0003-Conflict-change-line-20.patch",
    )
    # Every patch ends in exactly one final state; the kept ones are renumbered.
    assert all(e.state in ("clean", "merged", "upstream") for e in state.patches)
    assert sorted(p.name for p in Series(into).patches()) == [
        "0001-Clean-change-line-35.patch",
        "0002-Merged-change-line-29.patch",
        "0003-Conflict-change-line-20.patch",
    ]
    assert 'version = "9.9.10"' in (into / "base.toml").read_text()
    # The resolution is kept in the store beside INTO, as diffs: rerere's
    # conflict and the whole port.
    store = into.parent / "resolutions"
    assert not (into / "resolutions").exists()
    (conflict,) = (store / "rerere").iterdir()
    assert sorted(p.name for p in conflict.iterdir()) == [
        "postimage.diff",
        "preimage.diff",
        "resolution.json",
    ]
    assert "-<<<<<<<\n-line XX\n" in (conflict / "postimage.diff").read_text()
    meta = json.loads((conflict / "resolution.json").read_text())
    assert meta["path"] == "vllm/v1/core/block_pool.py" and meta["blob"]
    (port,) = (store / "ports").iterdir()
    assert (port / "port.json").is_file()
    report = (into / "REBASE.md").read_text()
    used = f"ports/{port.name}, rerere/{conflict.name}"
    assert f"Recorded resolutions used (patches/resolutions/): {used}" in report
    assert "| 0003-Fix-popleft_n-raises-ValueError.patch | upstream |" in report
    assert f"| {REPRODUCER} | passes |" in report
    # The tree is what `make apply` builds from the new series.
    new_series = Series(into, overlay=five.series.overlay)
    assert git(five.tree, "rev-parse", "--abbrev-ref", "HEAD") == "fork/v9.9.10"
    assert apply_series(new_series, five.tree, five.cache) is False
    text = (five.tree / "vllm/v1/core/block_pool.py").read_text()
    for line in ("line thirty-five", "line twenty-nine", "line twenty", "line 2.5"):
        assert line + "\n" in text
    assert snapshot(five.series.dir) == series_before
    assert not rebase_state.state_exists(five.tree)
    assert "0003-Conflict-change-line-20.patch" in capsys.readouterr().err


def test_a_recorded_resolution_is_replayed(five, project, tmp_path):
    with pytest.raises(ForkError):
        start(five, project)
    resolve_by_hand(five.tree)
    rebase.resume(five.tree)
    into = tmp_path / "into"
    first = snapshot(into)
    # Another checkout, nothing but the series and INTO: no hand edit needed,
    # and the same bytes come out.
    state = start(five, project, tree=tmp_path / "elsewhere")
    assert [(e.state, e.detail) for e in state.patches][4] == (
        "merged",
        "recorded resolution",
    )
    assert snapshot(into) == first


def test_a_port_is_replayed_whole(five, project, tmp_path):
    # A port may change a file the merge did not conflict in: rerere knows
    # nothing of that file, the recorded port does.
    with pytest.raises(ForkError):
        start(five, project)
    resolve_by_hand(five.tree)
    other = "vllm/v1/core/kv_cache_utils.py"
    (five.tree / other).write_text("def popleft_n(n):  # ported\n    assert n\n")
    git(five.tree, "add", other)
    rebase.resume(five.tree)
    into = tmp_path / "into"
    first = snapshot(into)
    assert "# ported" in first["0003-Conflict-change-line-20.patch"].decode()
    state = start(five, project, tree=tmp_path / "elsewhere")
    assert [(e.state, e.detail) for e in state.patches][4] == (
        "merged",
        "recorded resolution",
    )
    assert snapshot(into) == first
    # A changed patch does not get the old port: rerere replays the hunk it
    # knows, but the port's edit of the other file would be lost, so the
    # rebase stops there for the user to carry it over.
    patch = five.series.dir / "0005-Conflict-change-line-20.patch"
    patch.write_text(patch.read_text().replace("Conflict: change", "Conflict: edit"))
    third = tmp_path / "third"
    with pytest.raises(ForkError, match="0005-Conflict-change-line-20.patch"):
        start(five, project, tree=third)
    state = rebase_state.State.load(third)
    entry = state.patches[4]
    assert entry.state == "conflict" and "ported by hand" in entry.detail
    assert "line twenty\n" in (third / "vllm/v1/core/block_pool.py").read_text()
    assert "# ported" not in (third / other).read_text()
    (third / other).write_text("def popleft_n(n):  # ported\n    assert n\n")
    git(third, "add", other)
    rebase.resume(third)
    assert "# ported" in (third / other).read_text()


def test_abort_puts_everything_back_and_keeps_the_unfinished_work(five, project):
    before = git(five.tree, "rev-parse", "HEAD")
    series_before = snapshot(five.series.dir)
    with pytest.raises(ForkError):
        start(five, project)
    (five.tree / "vllm/v1/core/block_pool.py").write_text("half resolved\n")
    rebase.abort(five.tree)
    assert git(five.tree, "rev-parse", "--abbrev-ref", "HEAD") == "fork/v9.9.9"
    assert git(five.tree, "rev-parse", "HEAD") == before
    assert git(five.tree, "status", "--porcelain") == ""
    assert git(five.tree, "branch", "--list", "fork/v9.9.10") == ""
    backups = git(five.tree, "branch", "--list", "backup/rebase-*").split()
    assert len(backups) == 1
    kept = git(five.tree, "show", f"{backups[0]}:vllm/v1/core/block_pool.py")
    assert kept == "half resolved"
    assert not rebase_state.state_exists(five.tree)
    assert snapshot(five.series.dir) == series_before
    assert not (five.tree.parent / "into").exists()
    with pytest.raises(ForkError, match="no rebase is in progress"):
        rebase.resume(five.tree)


def test_continue_refuses_unresolved_files_and_changes_nothing(five, project):
    with pytest.raises(ForkError):
        start(five, project)
    with pytest.raises(ForkError, match="still has unresolved files"):
        rebase.resume(five.tree)
    # Staged with the markers still in: refused as well.
    git(five.tree, "add", "vllm/v1/core/block_pool.py")
    with pytest.raises(ForkError, match="conflict markers"):
        rebase.resume(five.tree)
    assert states(five.tree)[4] == ("0005", "conflict")
    assert rebase_replay.am_in_progress(five.tree)


def test_resolving_to_the_new_code_drops_the_patch(five, project):
    with pytest.raises(ForkError):
        start(five, project)
    resolve_by_hand(five.tree, "line XX\n")
    state = rebase.resume(five.tree)
    assert (state.patches[4].state, state.patches[4].new_name) == ("upstream", "")
    assert "resolved to 9.9.10's code" in state.patches[4].detail
    assert len(Series(five.tree.parent / "into").patches()) == 2


def test_am_finished_by_hand_is_taken_in(five, project):
    with pytest.raises(ForkError):
        start(five, project)
    resolve_by_hand(five.tree)
    git(five.tree, "am", "--continue")
    state = rebase.resume(five.tree)
    assert (state.patches[4].state, state.patches[4].detail) == (
        "merged",
        "resolved by hand",
    )
    assert len(Series(five.tree.parent / "into").patches()) == 3


def test_am_aborted_by_hand_replays_the_patch_again(five, project):
    with pytest.raises(ForkError):
        start(five, project)
    git(five.tree, "am", "--abort")
    with pytest.raises(ForkError, match="0005-Conflict"):
        rebase.resume(five.tree)
    assert states(five.tree)[4] == ("0005", "conflict")


def test_refusals_change_nothing(five, project, tmp_path):
    (five.tree / "vllm/v1/core/block_pool.py").write_text("my edit\n")
    with pytest.raises(ForkError, match="uncommitted changes"):
        start(five, project)
    assert (five.tree / "vllm/v1/core/block_pool.py").read_text() == "my edit\n"
    assert git(five.tree, "rev-parse", "--abbrev-ref", "HEAD") == "fork/v9.9.9"
    git(five.tree, "checkout", "--", ".")
    # INTO with uncommitted changes in the project's repository.
    repo = tmp_path / "repo"
    into = repo / "patches" / "v9.9.10"
    into.mkdir(parents=True)
    git(repo, "init", "-q")
    (into / "notes.txt").write_text("mine\n")
    with pytest.raises(ForkError, match="(?s)uncommitted changes.*notes.txt"):
        start(five, project, into=into)
    assert (into / "notes.txt").read_text() == "mine\n"
    # A second rebase while one is in progress.
    with pytest.raises(ForkError):
        start(five, project)
    with pytest.raises(ForkError, match="middle of `make rebase`"):
        start(five, project)


def test_state_is_plain_json_in_the_git_dir(five, project):
    with pytest.raises(ForkError):
        start(five, project)
    path = five.tree / ".git" / "vllm-fork-rebase.json"
    data = json.loads(path.read_text())
    assert data["new_base"]["version"] == "9.9.10"
    assert data["stopped_at"] == 4
    assert (five.tree / ".git" / "vllm-fork-rebase").is_dir()


def test_a_git_ref_as_the_new_base(five, project, tmp_path):
    # Upstream's repository, with the new release as a branch.
    origin = tmp_path / "origin"
    origin.mkdir()
    git(origin, "init", "-q", "-b", "main")
    files = {**UPSTREAM_FILES, **NEW_RELEASE}
    for name, text in files.items():
        (origin / name).parent.mkdir(parents=True, exist_ok=True)
        (origin / name).write_text(text)
    git(origin, "add", "-A")
    git(origin, "commit", "-q", "-m", "upstream")
    new = rebase.parse_base("main", "9.10.0.dev0", str(origin), five.series.base())
    assert (new.source, new.git_commit) == ("git", git(origin, "rev-parse", "HEAD"))
    with pytest.raises(ForkError, match="say which version"):
        rebase.parse_base("main", None, str(origin), five.series.base())
    into = tmp_path / "into-git"
    with pytest.raises(ForkError, match="0005"):
        rebase.start(
            five.series,
            new,
            into,
            five.tree,
            five.cache,
            python=Path(sys.executable),
            repro_root=project,
            base_tree=tmp_path / "base-git",
            logs=tmp_path / "logs",
        )
    resolve_by_hand(five.tree)
    rebase.resume(five.tree)
    base_toml = (into / "base.toml").read_text()
    assert f'git_commit = "{new.git_commit}"' in base_toml
    assert "sdist" not in base_toml
    assert (
        apply_series(Series(into, five.series.overlay), five.tree, five.cache) is False
    )


def test_an_interrupted_replay_resumes_without_losing_a_patch(
    five, project, monkeypatch
):
    real, calls = rebase.replay_one, []

    def interrupted(*args, **kwargs):
        calls.append(args[1].name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C while patch 3 is replayed
        return real(*args, **kwargs)

    monkeypatch.setattr(rebase, "replay_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        start(five, project)
    assert [s for _, s in states(five.tree)][2:] == ["pending"] * 3
    monkeypatch.setattr(rebase, "replay_one", real)
    with pytest.raises(ForkError, match="0005-Conflict"):
        rebase.resume(five.tree)
    resolve_by_hand(five.tree)
    state = rebase.resume(five.tree)
    assert [e.state for e in state.patches] == [
        "clean",
        "merged",
        "upstream",
        "upstream",
        "merged",
    ]


def test_a_kept_patch_names_only_reproducers_that_fail_on_the_new_release(
    upstream, project
):
    # One patch, two reproducers: the new release fixes what the first one
    # shows (popleft_n), not what the second shows (line 35).
    (project / "tests/reproducers/test_line35.py").write_text(
        "from pathlib import Path\n\nimport vllm\n\n\n"
        "def test_line_35_is_spelled_out():\n"
        "    pool = Path(vllm.__file__).parent / 'v1/core/block_pool.py'\n"
        "    assert 'line thirty-five' in pool.read_text()\n"
    )
    still = "tests/reproducers/test_line35.py::test_line_35_is_spelled_out"
    upstream.add_patch(
        "vllm/v1/core/block_pool.py",
        LINES.replace("line 35\n", "line thirty-five\n"),
        f"Clean: change line 35\n\nReproducer: {REPRODUCER}\nReproducer: {still}",
    )
    state = start(upstream, project)
    entry = state.patches[0]
    assert entry.state == "clean"
    assert "1 of its reproducers pass or skip on 9.9.10" in entry.detail
    kept = Series(upstream.tree.parent / "into").patches()
    assert [p.reproducers() for p in kept] == [[still]]


def test_a_kept_patch_drops_reproducers_that_skip_on_the_new_release(upstream, project):
    # A reproducer that skips itself on the new release (what it sets up
    # does not happen there) can never fail on that base: it leaves the
    # trailers too, while one that still fails stays.
    (project / "tests/reproducers/test_line35.py").write_text(
        "from pathlib import Path\n\nimport pytest\nimport vllm\n\n\n"
        "def test_line_35_is_spelled_out():\n"
        "    pool = Path(vllm.__file__).parent / 'v1/core/block_pool.py'\n"
        "    assert 'line thirty-five' in pool.read_text()\n\n\n"
        "def test_not_on_this_release():\n"
        "    pytest.skip('nothing to set up here')\n"
    )
    still = "tests/reproducers/test_line35.py::test_line_35_is_spelled_out"
    skips = "tests/reproducers/test_line35.py::test_not_on_this_release"
    upstream.add_patch(
        "vllm/v1/core/block_pool.py",
        LINES.replace("line 35\n", "line thirty-five\n"),
        f"Clean: change line 35\n\nReproducer: {still}\nReproducer: {skips}",
    )
    state = start(upstream, project)
    assert state.patches[0].state == "clean"
    kept = Series(upstream.tree.parent / "into").patches()
    assert [p.reproducers() for p in kept] == [[still]]


def test_the_nearest_series_on_the_way_from_the_default_one(tmp_path, monkeypatch):
    from lib import series as series_module

    def make(d: Path, version: str) -> None:
        d.mkdir(parents=True, exist_ok=True)
        base = f'version = "{version}"\nsdist_url = "u"\nsdist_sha256 = "{"0" * 64}"\n'
        (d / "base.toml").write_text(base)

    root = tmp_path / "patches"
    make(root, "0.20.2")
    for v in ("0.19.1", "0.20.1", "0.21.0", "0.22.0", "0.33.0"):
        make(root / f"v{v}", v)
    monkeypatch.setattr(rebase, "DEFAULT_SERIES", root)
    monkeypatch.setattr(series_module, "DEFAULT_SERIES", root)

    def nearest(version: str) -> str:
        return rebase.nearest_series(version).base().version

    # Newer releases follow the newest series below them, older ones the
    # oldest above them: every series descends from patches/.
    assert nearest("0.22.1") == "0.22.0"
    assert nearest("0.34.0") == "0.33.0"
    assert nearest("0.22.0") == "0.21.0"  # its own series is not its source
    assert nearest("0.20.0") == "0.20.1"
    assert nearest("0.19.0") == "0.19.1"
    assert nearest("0.20.1") == "0.20.2"
    assert nearest("0.21.0") == "0.20.2"


def test_a_patch_that_applies_is_adapted_with_edit_and_replayed(
    five, project, tmp_path
):
    # The new release needs patch 1 changed although it applies (say, code
    # it relies on grew a case): EDIT= stops after it; the amended commit is
    # recorded and replayed by the next rebase, with no stop.
    tmp = five.tree.parent

    def go(tree: Path, edit: list[str]):
        return start(five, project, tree=tree, edit=edit)

    with pytest.raises(ForkError, match="stopped after 0001-Clean-change-line-35"):
        go(five.tree, ["1"])
    path = five.tree / "vllm/v1/core/block_pool.py"
    path.write_text(path.read_text() + "adapted to 9.9.10\n")
    git(five.tree, "commit", "-q", "-a", "--amend", "--no-edit")
    with pytest.raises(ForkError, match="0005-Conflict"):
        rebase.resume(five.tree)
    assert rebase_state.State.load(five.tree).patches[0].detail == "adapted by hand"
    resolve_by_hand(five.tree)
    rebase.resume(five.tree)
    first = snapshot(tmp / "into")
    assert "+adapted to 9.9.10" in first["0001-Clean-change-line-35.patch"].decode()
    assert "| adapted (recorded) |" in first["REBASE.md"].decode()

    state = go(tmp_path / "elsewhere", [])
    assert [(e.state, e.detail) for e in state.patches][0] == (
        "merged",
        "recorded adaptation",
    )
    assert snapshot(tmp / "into") == first


def test_a_changed_patch_stops_where_its_adaptation_is_not_carried(
    five, project, tmp_path
):
    # Patch 1 was adapted to the release with EDIT=; then the patch changed
    # (here only its message). It still applies clean there, but applying
    # it as it is would drop the adaptation in silence (0008 on 0.20.1 lost
    # its port that way): the rebase stops for the adaptation to be carried.
    with pytest.raises(ForkError, match="stopped after 0001"):
        start(five, project, edit=["1"])
    path = five.tree / "vllm/v1/core/block_pool.py"
    path.write_text(path.read_text() + "adapted to 9.9.10\n")
    git(five.tree, "commit", "-q", "-a", "--amend", "--no-edit")
    with pytest.raises(ForkError, match="0005-Conflict"):
        rebase.resume(five.tree)
    resolve_by_hand(five.tree)
    rebase.resume(five.tree)
    first = five.series.dir / "0001-Clean-change-line-35.patch"
    first.write_text(first.read_text().replace("\n---\n", "\nA new line.\n---\n", 1))
    second = tmp_path / "second"
    with pytest.raises(ForkError, match="hand port recorded for it on these files"):
        start(five, project, tree=second)
    # Carried over (amended), it goes on; an unchanged one would stop again.
    path = second / "vllm/v1/core/block_pool.py"
    path.write_text(path.read_text() + "adapted to 9.9.10\n")
    git(second, "commit", "-q", "-a", "--amend", "--no-edit")
    rebase.resume(second)  # patch 5's resolution is replayed
    into = snapshot(five.tree.parent / "into")
    assert "+adapted to 9.9.10" in into["0001-Clean-change-line-35.patch"].decode()
    assert "A new line." in into["0001-Clean-change-line-35.patch"].decode()
    assert "| adapted (recorded) |" in into["REBASE.md"].decode()


def test_edit_must_name_a_patch_and_an_unchanged_stop_records_nothing(
    five, project, tmp_path
):
    def go(tree: Path, edit: list[str]):
        return start(five, project, tree=tree, edit=edit)

    head_before = git(five.tree, "rev-parse", "HEAD")
    with pytest.raises(ForkError, match="EDIT=99 names no patch"):
        go(five.tree, ["99"])
    assert git(five.tree, "rev-parse", "HEAD") == head_before
    assert not rebase_state.state_exists(five.tree)
    # Stopped by EDIT= and continued without amending: kept as it applied,
    # no adaptation recorded.
    with pytest.raises(ForkError, match="stopped after 0001"):
        go(five.tree, ["0001"])
    with pytest.raises(ForkError, match="0005-Conflict"):
        rebase.resume(five.tree)
    entry = rebase_state.State.load(five.tree).patches[0]
    assert (entry.state, entry.port) == ("clean", "")


def test_a_new_adaptation_replaces_the_stored_one(five, project, tmp_path):
    def go(tree: Path, edit: list[str], line: str):
        with pytest.raises(ForkError, match="stopped after"):
            start(five, project, tree=tree, edit=edit)
        path = tree / "vllm/v1/core/block_pool.py"
        path.write_text(path.read_text() + line)
        git(tree, "commit", "-q", "-a", "--amend", "--no-edit")
        try:
            rebase.resume(tree)
        except ForkError:  # patch 5: its conflict, or its port now stale
            if "<<<<<<<" in path.read_text():
                resolve_by_hand(tree)
            rebase.resume(tree)

    go(five.tree, ["1"], "adaptation A\n")
    go(tmp_path / "second", ["1"], "adaptation B\n")
    # A third checkout replays the latest adaptation, A and B.
    state = start(five, project, tree=tmp_path / "third")
    assert state.patches[0].detail == "recorded adaptation"
    text = (tmp_path / "third" / "vllm/v1/core/block_pool.py").read_text()
    assert "adaptation A\n" in text and "adaptation B\n" in text
