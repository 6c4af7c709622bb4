"""Results of test runs kept by what they were computed from.

`make export` runs upstream's scheduler tests (about 1,350) on each patch's
base and branch. Several patches share a base (each exported alone onto the
same ref), a stacked patch's base is the branch of the patch before it, and
a second `make export` runs everything again: the same files, the same
tests, the same environment, and so the same outcomes. A run's outcome is
kept under .work/test-results/<key>/ and served again for the same key.

The key is a hash of everything the outcome depends on:
  - the tested tree's content: the git tree of its working files, tracked
    and untracked (what `git add -A` would record; ignored files such as
    .mypy_cache or .hypothesis are not part of it), so a commit id, a date
    or a checkout's path changes nothing, and one changed byte misses;
  - the files the run reads besides the tree: the pytest plugin and
    Hugging Face configs of tests/upstream_env and testenv.py, which sets
    the environment up; for the reproducers (run from the repository root)
    also this project's tests/ (the harness; not tests/tooling and
    tests/harness_tests) and scripts/lib, scripts/prove and scripts/data;
  - the command: its arguments (the test selection) and where it runs;
  - the Python environment: the interpreter and every installed
    distribution with its version.
Nothing expires by time: an entry is valid as long as its inputs exist.

An entry is written in a directory of its own under tmp/ and renamed into
place only when the run finished (pytest exit status 0, 1 or 5: it ran to
the end and wrote its report), so an interrupted or crashed run leaves
nothing that a later run trusts; tmp/ entries of processes that are gone
are removed on the next run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from lib.paths import ROOT, WORK, rel
from lib.proc import git, run
from lib.testenv import run_pytest

CACHE_DIR = WORK / "test-results"
# Bump when what an entry holds or how its key is made changes.
FORMAT = 1
# pytest's exit statuses of a session that ran to its end: all passed, some
# failed, nothing collected. 2 (interrupted), 3 (internal error) and 4
# (usage) are not outcomes of the tests and are never kept.
FINISHED = (0, 1, 5)
# What every run reads besides the tree: the pytest and platform plugins
# and Hugging Face configs (tests/upstream_env) and the code that sets the
# environment up.
ENV_FILES = [ROOT / "tests" / "upstream_env", ROOT / "scripts" / "lib" / "testenv.py"]
# What a run from the repository root (the reproducers) also reads: the
# harness and what it imports or loads from scripts/. Not the project's own
# tests of its tooling (tests/tooling, tests/harness_tests).
HARNESS_SKIPS = {"tooling", "harness_tests"}
SCRIPTS_READ = ("lib", "prove", "data")


# Set by `make export --fresh-tests`: run everything again, replacing entries.
FRESH = False


class Stats:
    """How many runs were served and how many ran (for the summary, tests)."""

    served = 0
    ran = 0


def tree_content(tree: Path) -> str:
    """The git tree id of `tree`'s working files, tracked and untracked.

    A copy of the checkout's index is updated with `git add -A`, so files
    whose stat data is unchanged are not read again."""
    index = Path(
        git(tree, "rev-parse", "--path-format=absolute", "--git-path", "index")
    )
    with tempfile.TemporaryDirectory(prefix="vllm-fork-index-") as tmp:
        scratch = Path(tmp) / "index"
        if index.exists():
            shutil.copyfile(index, scratch)
        env = {"GIT_INDEX_FILE": str(scratch)}
        git(tree, "add", "-A", "--", ".", env=env)
        return git(tree, "write-tree", env=env)


def files_content(paths: list[Path]) -> str:
    """A hash of the files under `paths` (names and bytes); bytecode caches
    are skipped."""
    h = hashlib.sha256()
    for top in paths:
        files = [top] if top.is_file() else sorted(top.rglob("*"))
        for f in files:
            if not f.is_file() or {"__pycache__", ".pytest_cache"} & set(f.parts):
                continue
            name = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
            h.update(f"{name}\0".encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


@functools.cache
def environment(python: Path) -> str:
    """The interpreter and its installed distributions, as one hash."""
    probe = (
        "import sys, importlib.metadata as m\n"
        "print(sys.version)\n"
        "print(sorted(f\"{d.metadata['Name']}=={d.version}\"\n"
        "             for d in m.distributions()))"
    )
    out = run([str(python), "-c", probe]).stdout
    return hashlib.sha256(f"{Path(python).absolute()}\n{out}".encode()).hexdigest()


def key_of(inputs: dict[str, object]) -> str:
    text = json.dumps({"format": FORMAT, **inputs}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _forget_abandoned() -> None:
    """Remove tmp/ entries of runs whose process is gone (interrupted)."""
    for d in (CACHE_DIR / "tmp").glob("*"):
        pid = d.name.split("-", 1)[0]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(d, ignore_errors=True)


def cached(
    inputs: dict[str, object],
    produce: Callable[[Path], int],
    deliver: Callable[[Path, bool], None],
) -> int:
    """The exit status of the run `inputs` describe, from the cache if it
    finished before, else from `produce(dir)`, which writes the run's files
    into `dir`. `deliver(dir, served)` then copies out what the caller
    needs. With FRESH it runs again and replaces the entry."""
    key = key_of(inputs)
    entry = CACHE_DIR / key[:2] / key
    meta = entry / "entry.json"
    if not FRESH and meta.exists():
        Stats.served += 1
        deliver(entry, True)
        return json.loads(meta.read_text())["status"]
    _forget_abandoned()
    tmp = CACHE_DIR / "tmp" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        status = produce(tmp)
        Stats.ran += 1
        deliver(tmp, False)
        if status in FINISHED:
            # entry.json last, and the directory renamed into place whole: a
            # directory under the key always holds a finished run.
            (tmp / "entry.json").write_text(
                json.dumps({"status": status, "inputs": inputs}, indent=1)
            )
            entry.parent.mkdir(parents=True, exist_ok=True)
            if entry.exists():  # FRESH, or another process finished first
                shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)
        return status
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pytest_inputs(python: Path, tree: Path, cwd: Path, args: list[str]) -> dict:
    inputs: dict[str, object] = {
        "kind": "pytest",
        "tree": tree_content(tree),
        "python": environment(python),
        "args": args,
        "env": files_content(ENV_FILES),
    }
    if cwd == ROOT:
        inputs["harness"] = files_content(harness_files())
    elif cwd != tree:
        # The files pytest is given are read from `cwd`.
        inputs["cwd"] = tree_content(cwd)
    return inputs


def harness_files() -> list[Path]:
    tests = sorted(p for p in (ROOT / "tests").iterdir() if p.name not in HARNESS_SKIPS)
    return tests + [ROOT / "scripts" / d for d in SCRIPTS_READ]


def run_pytest_cached(
    python: Path,
    tree: Path,
    cwd: Path,
    junit: Path,
    args: list[str],
    log: Path,
) -> int:
    """run_pytest, served from the cache when the same run finished before;
    the report and the log land at `junit` and `log` either way."""

    def produce(d: Path) -> int:
        return run_pytest(python, tree, cwd, d / "junit.xml", args, d / "log")

    def deliver(d: Path, served: bool) -> None:
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.unlink(missing_ok=True)
        if (d / "junit.xml").exists():
            shutil.copyfile(d / "junit.xml", junit)
        text = (d / "log").read_text() if (d / "log").exists() else ""
        if served:
            text = f"(served from {rel(d)}: same tree, tests and environment)\n{text}"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)

    return cached(pytest_inputs(python, tree, cwd, args), produce, deliver)
