"""apply, cut short at every stage (the fetch, the checkout of the base, the
k-th `git am`, the overlay commit) and run again: the tree is finished or
back as it was, never left for the user to commit (issue 41)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import UPSTREAM_FILES, Upstream, git, make_sdist, sha256

import keep.apply as apply_mod
from keep.apply import apply_series
from keep.interrupted import read_marker
from keep.refresh import refresh_series
from lib.errors import ForkError
from lib.proc import git_bytes
from lib.series import Base, Series

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# The second release: nine files the first has are gone, one is added and
# one changed, none of them a file the series touches.
GONE = [f"vllm/old/m{i}.py" for i in range(9)]
FIRST = {**UPSTREAM_FILES, **{p: f"old = {i}\n" for i, p in enumerate(GONE)}}
SECOND = {**UPSTREAM_FILES, "setup.py": "print('setup 2')\n", "vllm/added.py": "a\n"}


@pytest.fixture(autouse=True)
def sigint_delivered():
    """A job that a non-interactive shell starts in the background (a CI
    runner may start `make test` so) ignores SIGINT, and so does every
    process it starts: the interrupts these tests send would be lost and
    nothing interrupted. With Python's handler set here, the git and make
    processes the tests start get SIGINT's default action again."""
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def two(upstream: Upstream) -> tuple[Upstream, Series]:
    """A series of three patches on 9.9.9, and the same patches on 9.9.10."""
    up = upstream
    sdist = make_sdist(up.sdist.parent, "9.9.9", FIRST)
    base = Base(version="9.9.9", sdist_url=sdist.as_uri(), sdist_sha256=sha256(sdist))
    up.series.base_file.write_text(base.to_toml())
    up.add_patch("vllm/v1/core/new.py", "x = 1\n", "Add new.py")
    up.add_patch("vllm/v1/core/kv_cache_utils.py", "def popleft_n(n):\n", "Two")
    up.add_patch("vllm/v1/core/third.py", "y = 2\n", "Add third.py")
    other = up.tree.parent / "patches-9.9.10"
    shutil.copytree(up.series.dir, other)
    sdist = make_sdist(up.sdist.parent, "9.9.10", SECOND)
    base = Base(version="9.9.10", sdist_url=sdist.as_uri(), sdist_sha256=sha256(sdist))
    (other / "base.toml").write_text(base.to_toml())
    return up, Series(other, overlay=up.series.overlay)


def reference(series: Series, cache: Path, where: Path) -> str:
    """HEAD of the series built in a tree of its own, uninterrupted."""
    apply_series(series, where, cache)
    return git(where, "rev-parse", "HEAD")


def assert_built(tree: Path, head: str) -> None:
    assert git(tree, "rev-parse", "HEAD") == head
    assert git(tree, "status", "--porcelain", "--untracked-files=all") == ""
    assert read_marker(tree) is None


def cut_checkout_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next `git checkout -B` stops halfway, as a killed one does: half
    the files that differ written or deleted, the index and HEAD unmoved."""
    real = apply_mod.git

    def git_cut(tree, *args, **kw):
        if args[:1] == ("checkout",) and "-B" in args:
            target = args[-1]
            empty = real(tree, "hash-object", "-t", "tree", os.devnull)
            head = real(tree, "rev-parse", "-q", "--verify", "HEAD", check=False)
            diff = real(
                tree, "diff", "--name-status", "--no-renames", head or empty, target
            )
            lines = diff.splitlines()
            for line in lines[: max(1, len(lines) // 2)]:
                status, path = line.split("\t")
                if status == "D":
                    (tree / path).unlink()
                else:
                    data = git_bytes(tree, "show", f"{target}:{path}")
                    (tree / path).parent.mkdir(parents=True, exist_ok=True)
                    (tree / path).write_bytes(data)
            raise KeyboardInterrupt
        return real(tree, *args, **kw)

    monkeypatch.setattr(apply_mod, "git", git_cut)


def kill_am_at(tree: Path, k: int, sig: str = "INT") -> None:
    """A hook that kills `git am` (its parent) once patch k is applied to the
    files but not yet committed; only the first time."""
    hooks = tree / ".git" / "hooks"
    hooks.mkdir(exist_ok=True)
    count = tree.parent / "am-count"
    hook = hooks / "pre-applypatch"
    hook.write_text(
        "#!/bin/sh\n"
        f'n=$(cat "{count}" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "{count}"\n'
        f'[ "$n" = "{k}" ] && kill -{sig} $PPID\n'
        "exit 0\n"
    )
    hook.chmod(0o755)


def test_an_interrupted_fetch_leaves_the_tree_as_it_was(two, monkeypatch):
    up, second = two
    head = git(up.tree, "rev-parse", "HEAD")

    def no_fetch(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(apply_mod, "ensure_base", no_fetch)
    with pytest.raises(KeyboardInterrupt):
        apply_series(second, up.tree, up.cache)
    monkeypatch.undo()
    assert git(up.tree, "rev-parse", "HEAD") == head
    assert git(up.tree, "status", "--porcelain") == ""
    want = reference(second, up.cache, up.tree.parent / "ref")
    assert apply_series(second, up.tree, up.cache)
    assert_built(up.tree, want)


def test_an_interrupted_checkout_is_finished_by_the_next_run(two, monkeypatch, capsys):
    """Issue 41's case: switching releases, cut short in the checkout, nine
    files deleted; the next run said "commit them". Now it rebuilds."""
    up, second = two
    cut_checkout_short(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        apply_series(second, up.tree, up.cache)
    monkeypatch.undo()
    assert git(up.tree, "status", "--porcelain")  # half-done, as in the issue
    err = capsys.readouterr().err
    assert "half-built" in err and "finishes it" in err
    want = reference(second, up.cache, up.tree.parent / "ref")
    assert apply_series(second, up.tree, up.cache)
    assert_built(up.tree, want)
    err = capsys.readouterr().err
    assert "was interrupted" in err and "Commit them" not in err


def test_the_old_release_asked_again_is_restored(two, monkeypatch):
    up, second = two
    head = git(up.tree, "rev-parse", "HEAD")
    cut_checkout_short(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        apply_series(second, up.tree, up.cache)
    monkeypatch.undo()
    assert apply_series(up.series, up.tree, up.cache) is False  # up to date again
    assert_built(up.tree, head)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_git_am_killed_at_the_kth_patch_is_finished(two, k):
    up, second = two
    want = reference(second, up.cache, up.tree.parent / "ref")
    kill_am_at(up.tree, k)
    with pytest.raises(KeyboardInterrupt):  # not reported as a conflict
        apply_series(second, up.tree, up.cache)
    assert (up.tree / ".git" / "rebase-apply").exists()
    marker = read_marker(up.tree)
    assert marker and marker["stage"] == "git am" and marker["release"] == "9.9.10"
    assert apply_series(second, up.tree, up.cache)
    assert_built(up.tree, want)


def test_a_git_am_killed_outright_leaves_locks_that_are_cleared(two):
    up, second = two
    want = reference(second, up.cache, up.tree.parent / "ref")
    kill_am_at(up.tree, 2, sig="KILL")
    with pytest.raises(KeyboardInterrupt):
        apply_series(second, up.tree, up.cache)
    (up.tree / ".git" / "index.lock").write_text("")  # what SIGKILL can leave
    assert apply_series(second, up.tree, up.cache)
    assert_built(up.tree, want)


def test_an_interrupt_before_the_release_tag_is_finished(two, monkeypatch):
    up, second = two
    real = apply_mod.lay_overlay

    def overlay_then_stop(*args, **kw):
        real(*args, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(apply_mod, "lay_overlay", overlay_then_stop)
    with pytest.raises(KeyboardInterrupt):
        apply_series(second, up.tree, up.cache)
    monkeypatch.undo()
    apply_series(second, up.tree, up.cache)  # the build is there: only the tag
    assert git(up.tree, "describe", "--tags") == "v9.9.10"
    assert read_marker(up.tree) is None


def test_the_first_build_of_a_new_tree_cut_short_is_finished(two, monkeypatch):
    up, second = two
    fresh = up.tree.parent / "fresh"
    want = reference(second, up.cache, up.tree.parent / "ref")
    cut_checkout_short(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        apply_series(second, fresh, up.cache)
    monkeypatch.undo()
    assert apply_series(second, fresh, up.cache)
    assert_built(fresh, want)


def test_a_tree_whose_git_init_was_cut_short_is_taken(two):
    up, second = two
    fresh = up.tree.parent / "fresh"
    git(up.tree.parent, "init", "-q", str(fresh))  # the key not yet set
    assert apply_series(second, fresh, up.cache)


def test_edits_made_after_the_interrupt_are_refused_and_kept(two, monkeypatch):
    up, second = two
    kill_am_at(up.tree, 2)
    with pytest.raises(KeyboardInterrupt):
        apply_series(second, up.tree, up.cache)
    mine = up.tree / "vllm/v1/core/new.py"
    mine.write_text("x = 'mine'\n")
    (up.tree / "notes.txt").write_text("mine\n")
    with pytest.raises(ForkError) as info:
        apply_series(second, up.tree, up.cache)
    msg = str(info.value)
    assert "interrupted" in msg and "vllm/v1/core/new.py" in msg
    assert "notes.txt" in msg and "stash -u" in msg and "Commit" not in msg
    assert mine.read_text() == "x = 'mine'\n"
    assert (up.tree / "notes.txt").read_text() == "mine\n"
    # Put aside as told, the next run finishes the build.
    git(up.tree, "stash", "-u")
    want = reference(second, up.cache, up.tree.parent / "ref")
    assert apply_series(second, up.tree, up.cache)
    assert_built(up.tree, want)


def test_refresh_of_a_half_built_tree_says_to_finish_the_apply(two, monkeypatch):
    up, second = two
    cut_checkout_short(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        apply_series(second, up.tree, up.cache)
    monkeypatch.undo()
    with pytest.raises(ForkError) as info:
        refresh_series(up.series, up.tree)
    msg = str(info.value)
    assert "half-built" in msg and "make apply SERIES=" in msg
    assert "Commit" not in msg


def test_a_real_conflict_is_still_handed_to_the_user(two):
    up, second = two
    files = {**SECOND, "vllm/v1/core/kv_cache_utils.py": "def other(n):\n"}
    sdist = make_sdist(up.sdist.parent, "9.9.10", files)
    base = Base(version="9.9.10", sdist_url=sdist.as_uri(), sdist_sha256=sha256(sdist))
    second.base_file.write_text(base.to_toml())
    with pytest.raises(ForkError, match="does not apply"):
        apply_series(second, up.tree, up.cache)
    assert read_marker(up.tree) is None
    with pytest.raises(ForkError, match="middle of a git am"):
        apply_series(second, up.tree, up.cache)


def test_ctrl_c_on_the_command_line_and_run_again(two, tmp_path):
    """The real thing: SIGINT to the whole process group (as a terminal's
    Ctrl-C or `timeout -s INT` sends it) while `git am` runs."""
    up, second = two
    env = {**os.environ, "VLLM_FORK_CACHE": str(up.cache)}
    cmd = [
        sys.executable,
        str(SCRIPTS / "keep" / "apply.py"),
        "--series",
        str(second.dir),
        "--tree",
        str(up.tree),
    ]
    hook = up.tree / ".git" / "hooks" / "pre-applypatch"
    hook.parent.mkdir(exist_ok=True)
    hook.write_text(f'#!/bin/sh\n[ -e "{tmp_path}/once" ] && exit 0\n')
    hook.write_text(hook.read_text() + f'touch "{tmp_path}/once"; kill -INT 0\n')
    hook.chmod(0o755)
    first = subprocess.run(
        cmd, env=env, capture_output=True, text=True, start_new_session=True
    )
    assert first.returncode in (130, -signal.SIGINT), first.stderr
    assert read_marker(up.tree) is not None
    again = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "was interrupted" in again.stderr
    assert git(up.tree, "status", "--porcelain") == ""
    assert git(up.tree, "describe", "--tags") == "v9.9.10"
