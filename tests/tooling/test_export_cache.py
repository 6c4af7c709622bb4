"""make export's cache of test results (scripts/lib/testcache.py) and its
choice of upstream's tests as vLLM's CI makes it (scripts/ship/ci_selection.py).

pytest itself is replaced by a stand-in that counts its runs and writes a
JUnit report naming the tree it ran on, so each test sees exactly which
runs were served and which ran, in seconds.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from lib import testcache
from lib.paths import CACHE
from lib.testenv import read_junit
from prove.release_trees import Trees
from prove.run_tests import upstream_tests
from ship import ci_selection

ARGS = ["--continue-on-collection-errors", "tests/v1/core"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "add", "-A")
    git(
        path,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "-qm",
        "base",
    )
    return path


class FakePytest:
    """Stands in for lib.testenv.run_pytest: one passing test per tree,
    named after the tree's scheduler.py ("fixed" in it: another passes)."""

    def __init__(self) -> None:
        self.runs: list[Path] = []
        self.status = 0
        self.interrupt = False

    def __call__(self, python, tree, cwd, junit, args, log) -> int:
        self.runs.append(Path(tree))
        text = (Path(tree) / "scheduler.py").read_text()
        names = ["test_a"] + (["test_fixed"] if "fixed" in text else [])
        cases = "".join(
            f'<testcase classname="tests.v1.core.test_s" name="{n}" '
            f'file="tests/v1/core/test_s.py"/>'
            for n in names
        )
        junit.write_text(f"<testsuites><testsuite>{cases}</testsuite></testsuites>")
        log.write_text(f"ran on {tree}\n")
        if self.interrupt:
            raise KeyboardInterrupt
        return self.status


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakePytest:
    stand_in = FakePytest()
    monkeypatch.setattr(testcache, "run_pytest", stand_in)
    monkeypatch.setattr(testcache, "CACHE_DIR", tmp_path / "results")
    monkeypatch.setattr(testcache, "environment", lambda python: "the env")
    monkeypatch.setattr(testcache, "FRESH", False)
    return stand_in


@pytest.fixture
def base(tmp_path) -> Path:
    return make_repo(tmp_path / "base", {"scheduler.py": "x = 1\n"})


def run(tree: Path, tmp_path: Path, args: list[str] = ARGS) -> dict[str, str]:
    junit, log = tmp_path / "out" / "j.xml", tmp_path / "out" / "log"
    testcache.run_pytest_cached(Path("python"), tree, tree, junit, args, log)
    return read_junit(junit)


def test_a_second_run_of_the_same_tree_is_served(fake, base, tmp_path):
    first = run(base, tmp_path)
    second = run(base, tmp_path)
    assert len(fake.runs) == 1
    assert first == second == {"tests/v1/core/test_s.py::test_a": "passed"}
    assert (tmp_path / "out" / "log").read_text().startswith("(served from ")


def test_the_key_is_the_content_not_the_checkout(fake, base, tmp_path):
    """Another checkout of the same commit (export's base worktree, made
    afresh for every patch) is served: its path and index are new."""
    run(base, tmp_path)
    other = tmp_path / "other"
    git(base, "worktree", "add", "-q", "--detach", str(other), "HEAD")
    run(other, tmp_path)
    assert fake.runs == [base]


@pytest.mark.parametrize("change", ["modified", "untracked", "args"])
def test_a_changed_tree_or_selection_is_not_served(fake, base, tmp_path, change):
    run(base, tmp_path)
    args = ARGS
    if change == "modified":
        (base / "scheduler.py").write_text("x = 2  # fixed\n")
    elif change == "untracked":
        # export writes the patch's new test files into the base's checkout
        (base / "tests" / "v1" / "core").mkdir(parents=True)
        (base / "tests" / "v1" / "core" / "test_new.py").write_text("")
    else:
        args = [*ARGS, "tests/v1/simple_kv_offload"]
    outcome = run(base, tmp_path, args)
    assert len(fake.runs) == 2
    if change == "modified":
        assert outcome["tests/v1/core/test_s.py::test_fixed"] == "passed"


def test_ignored_files_do_not_change_the_key(fake, base, tmp_path):
    (base / ".gitignore").write_text(".mypy_cache/\n")
    git(base, "add", ".gitignore")
    run(base, tmp_path)
    (base / ".mypy_cache").mkdir()
    (base / ".mypy_cache" / "x.json").write_text("{}")
    run(base, tmp_path)
    assert len(fake.runs) == 1


def test_an_interrupted_run_leaves_nothing_trusted(fake, base, tmp_path):
    fake.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        run(base, tmp_path)
    fake.interrupt = False
    fake.status = 2  # pytest's "interrupted": its report is partial
    run(base, tmp_path)
    fake.status = 0
    run(base, tmp_path)
    assert len(fake.runs) == 3
    run(base, tmp_path)
    assert len(fake.runs) == 3


def test_only_a_finished_entry_is_trusted(fake, base, tmp_path):
    """A directory under the key without entry.json (a copy cut short, a
    crash between writes) runs again; tmp/ left by a process that is gone
    is removed, that of a live one kept."""
    run(base, tmp_path)
    (entry,) = [d for d in testcache.CACHE_DIR.glob("*/*") if d.parent.name != "tmp"]
    (entry / "entry.json").unlink()
    dead = subprocess.Popen(["true"])
    dead.wait()
    abandoned = testcache.CACHE_DIR / "tmp" / f"{dead.pid}-0000"
    live = testcache.CACHE_DIR / "tmp" / f"{os.getpid()}-1111"
    for d in (abandoned, live):
        d.mkdir(parents=True)
    run(base, tmp_path)
    assert len(fake.runs) == 2
    assert not abandoned.exists() and live.exists()
    assert (entry / "entry.json").exists()


def test_fresh_runs_again_and_keeps_the_new_result(fake, base, tmp_path, monkeypatch):
    run(base, tmp_path)
    monkeypatch.setattr(testcache, "FRESH", True)
    run(base, tmp_path)
    monkeypatch.setattr(testcache, "FRESH", False)
    run(base, tmp_path)
    assert len(fake.runs) == 2


def test_export_tests_a_shared_or_stacked_base_once(fake, base, tmp_path):
    """upstream_tests as export calls it: two patches exported alone onto
    the same ref test the ref once; a patch stacked on the first finds its
    base (that patch's branch) tested already; a second export runs
    nothing, with the same verdicts."""
    git(base, "branch", "ref")

    def branch(name: str, start: str, text: str) -> Path:
        wt = tmp_path / name
        git(base, "worktree", "add", "-q", "-b", name, str(wt), start)
        (wt / "scheduler.py").write_text(text)
        git(wt, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", name)
        return wt

    one = branch("one", "ref", "x = 1  # fixed\n")
    two = branch("two", "ref", "x = 3\n")
    three = branch("three", "one", "x = 4  # fixed\n")

    def export() -> list[tuple[bool, str]]:
        verdicts = []
        for start, wt in ((base, one), (base, two), (one, three)):
            trees = Trees(None, "0.0.0", start, wt)  # type: ignore[arg-type]
            verdicts.append(
                upstream_tests(
                    Path("python"),
                    trees,
                    f"cache-{wt.name}",
                    ["tests/v1/core"],
                    testcache.run_pytest_cached,
                )
            )
        return verdicts

    first = export()
    assert sorted(map(str, fake.runs)) == sorted(map(str, [base, one, two, three]))
    assert [ok for ok, _ in first] == [True, True, True]
    second = export()
    assert len(fake.runs) == 4
    assert second == first


PIPELINE = """
steps:
- label: V1 Core
  source_file_dependencies: &core-deps
    - vllm/v1/
    - "!vllm/v1/attention/"
    - tests/v1/core
  commands:
    - pytest -v -s -m 'not cpu_test' v1/core
- label: V1 KV Offload
  source_file_dependencies: *core-deps
  commands:
    - pytest -v -s v1/kv_offload
    - pytest -v -s v1/simple_kv_offload
- label: Docs
  source_file_dependencies:
    - docs/
  commands:
    - pytest -v -s v1/core/test_docs_only.py
"""
DIRS = ["tests/v1/core", "tests/v1/simple_kv_offload"]


@pytest.mark.parametrize(
    "changed,dirs",
    [
        (["vllm/v1/core/sched/scheduler.py"], DIRS),
        (["tests/v1/core/test_new.py"], DIRS),
        (["vllm/v1/attention/backend.py"], []),
        (["docs/index.md"], ["tests/v1/core"]),
        (["README.md"], []),
    ],
)
def test_ci_selection_follows_source_file_dependencies(tmp_path, changed, dirs):
    (tmp_path / ".buildkite" / "test_areas").mkdir(parents=True)
    (tmp_path / ".buildkite" / "test_areas" / "misc.yaml").write_text(PIPELINE)
    chosen = ci_selection.selection(tmp_path, changed, DIRS)
    assert chosen["read"] and chosen["dirs"] == dirs


def test_ci_selection_without_a_pipeline_says_so(tmp_path):
    assert ci_selection.selection(tmp_path, ["vllm/x.py"], DIRS)["read"] is False


def test_ci_selection_on_the_real_release_keeps_both_for_the_scheduler(tmp_path):
    """0.33.0's pipeline runs tests/v1/core and tests/v1/simple_kv_offload
    for any change under vllm/v1/ (the fork's patches): export runs both,
    as before; a change to docs alone runs neither."""
    sdist = CACHE / "sdist" / "vllm-0.33.0.tar.gz"
    if not sdist.exists():
        pytest.skip(f"{sdist} not downloaded")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/.buildkite/" in m.name]
        tar.extractall(tmp_path, members=members, filter="data")
    tree = tmp_path / "vllm-0.33.0"
    for changed in (
        ["vllm/v1/core/sched/scheduler.py"],
        ["vllm/v1/simple_kv_offload/manager.py"],
        ["vllm/v1/core/kv_cache_utils.py", "tests/v1/core/test_x.py"],
    ):
        assert ci_selection.selection(tree, changed, DIRS)["dirs"] == DIRS
    assert ci_selection.selection(tree, ["docs/index.md"], DIRS)["dirs"] == []
