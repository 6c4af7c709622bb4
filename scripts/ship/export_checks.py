"""The checks `make export` runs on each exported branch, as vLLM would.

vLLM's pre-commit and CI look at a pull request this way, and so does this:
  - DCO: the commit's author signed it off;
  - ruff check and ruff format with the branch's own settings, on the
    changed Python files; the SPDX header on every new one;
  - mypy on the changed files as vLLM's pre-commit runs it
    (tools/pre_commit/mypy.py, in an environment of its own holding the
    hook's pinned mypy and additional dependencies, not vLLM's);
  - the tests: the patch must add tests under vLLM's tests/; they must pass
    on the branch and fail on the commit it is based on (each one that
    fails there, for a reason in the test, not at import); and every test
    of tests/v1/core and tests/v1/simple_kv_offload (those of the two that
    vLLM's CI runs for the files the patch changes: ci_selection.py) that
    passes on the base passes on the branch;
  - the patch's reproducers (the fork's harness, tests/reproducers/) on the
    commit it is based on and on the branch: all pass on the branch, at
    least one fails before; their table is the PR's before/after figures.
Each check returns the problems it found (none: it passed), a line for
the PR description, and any table of figures for it. The test runs and
mypy are served from lib/testcache.py's results when the same tree was
checked the same way before (a base that patches share, a stacked patch's
base, which is the branch before it, a second export).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lib import testcache
from lib.cli import step
from lib.errors import ForkError
from lib.paths import ROOT, WORK, rel
from lib.proc import git, run
from lib.series import Patch, Series
from lib.testenv import exception_type, read_junit_details, reproducer_verdicts
from lib.venv import RELEASE_VENVS
from prove.run_tests import UPSTREAM_TESTS, Trees, ruff, upstream_tests

# What vLLM's check_spdx_header.py wants at the top of every new file.
SPDX_LINES = (
    "# SPDX-License-Identifier: Apache-2.0",
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project",
)
# A test that fails on the base with one of these never ran what it tests:
# it imports or names what the patch adds.
NOT_RUN_TYPES = {"ImportError", "ModuleNotFoundError", "NameError"}
LOGS = WORK / "logs" / "export"
CI_SELECTION = Path(__file__).with_name("ci_selection.py")


@dataclass
class CheckResult:
    problems: list[str]
    summary: str
    # Markdown lines of figures for the PR description (a table).
    figures: list[str] = field(default_factory=list)


def changed_python_files(worktree: Path, base: str, diff_filter: str) -> list[str]:
    return git(
        worktree,
        "diff",
        "--name-only",
        f"--diff-filter={diff_filter}",
        base,
        "HEAD",
        "--",
        "*.py",
    ).split()


def dco(worktree: Path, commit: str, signer: str) -> CheckResult:
    """vLLM's DCO check: the commit's author signed it off. Export makes the
    one who runs it the author (the patch's author is credited as
    co-author), so both must name `signer`."""
    author = git(worktree, "log", "-1", "--format=%an <%ae>", commit)
    body = git(worktree, "log", "-1", "--format=%B", commit)
    problems = []
    if author != signer:
        problems.append(f"DCO: the author is {author}, not {signer} who signs off")
    if f"Signed-off-by: {signer}" not in body.splitlines():
        problems.append(f"DCO: no 'Signed-off-by: {signer}' line")
    return CheckResult(problems, f"DCO: signed off by its author, {signer}")


def lint(worktree: Path, base: str) -> CheckResult:
    """ruff with the tree's own settings, and SPDX headers on new files."""
    problems = []
    ok, detail = ruff(changed_python_files(worktree, base, "d"), worktree)
    if not ok:
        problems.append(f"ruff (vLLM's settings): {detail}")
    for f in changed_python_files(worktree, base, "A"):
        head = (worktree / f).read_text().splitlines()[:4]
        missing = [line for line in SPDX_LINES if line not in head]
        if missing:
            problems.append(
                f"{f}: a new file starts with vLLM's SPDX header; missing "
                + " and ".join(repr(m) for m in missing)
            )
    return CheckResult(problems, "ruff check and ruff format: clean; SPDX headers")


def mypy_hook(worktree: Path) -> tuple[str, list[str]]:
    """The mypy hook of the tree's pre-commit config: the Python version its
    entry passes to tools/pre_commit/mypy.py, and its pinned mypy and
    additional dependencies."""
    config = worktree / ".pre-commit-config.yaml"
    text = config.read_text() if config.exists() else ""
    # The hook's own block: from its `- id: mypy` to the next hook.
    m = re.search(
        r"^(\s*)- id: mypy(?:\s*#[^\n]*)?\s*$(.*?)(?=^\1- id: |\Z)", text, re.M | re.S
    )
    block = m.group(2) if m else ""
    entry = re.search(r"entry:\s*python tools/pre_commit/mypy\.py\s+\"?([\d.]+)", block)
    deps = re.search(r"additional_dependencies:\s*\[([^\]]*)\]", block)
    if not (entry and deps):
        raise ForkError(
            f"{rel(config)}: no mypy hook running tools/pre_commit/mypy.py with "
            "additional_dependencies: this ref's pre-commit is not one export "
            "knows (skip it with --no-tests)"
        )
    requirements = [d.strip().strip("'\"") for d in deps.group(1).split(",")]
    return entry.group(1), [r for r in requirements if r]


def mypy_venv(requirements: list[str]) -> Path:
    """An environment holding just the hook's requirements (as pre-commit
    makes one), cached by their list."""
    key = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:12]
    venv = RELEASE_VENVS / f"mypy-{key}"
    if not (venv / ".complete").exists():
        step(f"installing vLLM's mypy hook ({requirements[0]}) into {rel(venv)}")
        shutil.rmtree(venv, ignore_errors=True)
        run(["python3", "-m", "venv", str(venv)])
        run([str(venv / "bin" / "pip"), "install", "-q", *requirements])
        (venv / ".complete").write_text("\n".join(requirements) + "\n")
    return venv


def mypy(worktree: Path, base: str) -> CheckResult:
    """The pre-commit hook on every Python file of the packages the patch
    changes (CI runs it on all files; the callers of a changed function
    are mostly in its own package, and all of vllm/ takes too long here)."""
    changed = changed_python_files(worktree, base, "d")
    if not changed:
        return CheckResult([], "mypy: no Python file changed")
    packages = sorted({str(Path(f).parent) for f in changed})
    files = git(worktree, "ls-files", "--", *(f"{d}/*.py" for d in packages)).split()
    version, requirements = mypy_hook(worktree)
    venv = mypy_venv(requirements)
    # Only the hook's environment: none of the caller's Python paths.
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PYTHONPATH": "", "MYPYPATH": ""}
    out: list[str] = []

    def produce(d: Path) -> int:
        proc = run(
            [str(venv / "bin" / "python"), "tools/pre_commit/mypy.py", version, *files],
            cwd=worktree,
            env=env,
            check=False,
        )
        (d / "output").write_text(proc.stdout + proc.stderr)
        # mypy says 0 (clean) or 1 (errors found); anything else is no verdict.
        return proc.returncode if proc.returncode in (0, 1) else 2

    def deliver(d: Path, served: bool) -> None:
        out.append((d / "output").read_text())

    # The same files with the same hook give the same verdict: a stacked
    # patch's rerun, or a second `make export`, reads it from the cache.
    inputs = {
        "kind": "mypy",
        "tree": testcache.tree_content(worktree),
        "hook": [version, *requirements],
        "files": files,
    }
    if testcache.cached(inputs, produce, deliver) != 0:
        text = "".join(out).strip()
        return CheckResult([f"mypy (vLLM's pre-commit hook):\n{text[-3000:]}"], "")
    return CheckResult(
        [],
        f"mypy as vLLM's pre-commit hook runs it: clean on {len(files)} files "
        f"of {', '.join(packages)}",
    )


def changed_test_tree(worktree: Path, base: str) -> tuple[list[str], list[str]]:
    """Python files the patch adds or changes under tests/: the test files
    among them, and all of them (conftest and helpers go to the base too)."""
    files = [
        f for f in changed_python_files(worktree, base, "AM") if f.startswith("tests/")
    ]
    return [f for f in files if Path(f).name.startswith("test_")], files


def tests(
    worktree: Path,
    base: str,
    base_tree: Path,
    series: Series,
    python: Path,
    label: str,
) -> CheckResult:
    """The patch's own tests and upstream's scheduler tests, on `base` (checked
    out at `base_tree`) and on the branch."""
    added, support = changed_test_tree(worktree, base)
    if not added:
        return CheckResult(
            [
                "adds no test under vLLM's tests/: a reviewer running "
                "`pytest tests/v1/core` sees nothing new"
            ],
            "",
        )
    LOGS.mkdir(parents=True, exist_ok=True)
    for f in support:
        (base_tree / f).parent.mkdir(parents=True, exist_ok=True)
        (base_tree / f).write_text((worktree / f).read_text())
    try:
        on_branch = _run(python, worktree, added, f"{label}-branch")
        on_base = _run(python, base_tree, added, f"{label}-base")
    finally:
        git(base_tree, "checkout", "-q", "--", ".")
        for f in support:
            if not git(base_tree, "ls-files", f):
                (base_tree / f).unlink()
    trees = Trees(series, series.base().version, base_tree, worktree)
    dirs, selected = ci_test_dirs(python, worktree, base)
    if dirs:
        regressions_ok, regressions = upstream_tests(
            python, trees, f"export/{label}", dirs, testcache.run_pytest_cached
        )
    else:
        regressions_ok, regressions = True, "not run"
    problems = []
    if not on_branch:
        problems.append(f"the new tests did not run: see {rel(LOGS)}/")
    problems += [
        f"{t}: {o} on the branch"
        for t, (o, _) in sorted(on_branch.items())
        if o != "passed"
    ]
    failing_on_base = [t for t, (o, _) in on_base.items() if o == "failed"]
    broken = [
        f"{t}: {m}"
        for t, (o, m) in sorted(on_base.items())
        if o == "error" or (o == "failed" and exception_type(m) in NOT_RUN_TYPES)
    ]
    if on_branch and not failing_on_base:
        problems.append("none of the new tests fails on the base: they prove nothing")
    if broken:
        problems.append(
            "on the base these fail before they test anything (they import or "
            "name what the patch adds; reach it through its module, e.g. "
            "getattr(kv_cache_utils, 'NoFreeBlocksError', None), or check an "
            "exception by type(err).__name__):\n  " + "\n  ".join(broken)
        )
    if not regressions_ok:
        problems.append(f"{' and '.join(dirs)}:\n{regressions}")
    summary = (
        f"{len(on_branch)} new tests ({', '.join(added)}): "
        f"{sum(o == 'passed' for o, _ in on_branch.values())} pass on the branch, "
        f"{len(failing_on_base)} fail on the base. {selected}: "
        + regressions.replace("\n", "; ")
    )
    return CheckResult(problems, summary)


def ci_test_dirs(python: Path, worktree: Path, base: str) -> tuple[list[str], str]:
    """Upstream's scheduler test dirs that vLLM's CI runs for the files the
    patch changes (ci_selection.py, read from the branch's .buildkite/, with
    the release's python, which has PyYAML), and a line saying so. All of
    them when the pipeline cannot be read: never fewer than CI would run."""
    changed = git(worktree, "diff", "--name-only", base, "HEAD").split()
    proc = run(
        [str(python), str(CI_SELECTION), str(worktree), ",".join(UPSTREAM_TESTS)]
        + changed,
        check=False,
    )
    try:
        chosen = json.loads(proc.stdout)
    except json.JSONDecodeError:
        chosen = {"read": False}
    if not chosen.get("read"):
        return list(UPSTREAM_TESTS), (
            f"{' and '.join(UPSTREAM_TESTS)} (vLLM's CI pipeline not readable "
            "here: all of them)"
        )
    dirs = chosen["dirs"]
    if not dirs:
        return [], f"vLLM's CI runs none of {', '.join(UPSTREAM_TESTS)} for its files"
    return dirs, f"{' and '.join(dirs)} (run by vLLM's CI for its files)"


def _run(python: Path, tree: Path, files: list[str], label: str) -> dict:
    junit, log = LOGS / f"{label}.xml", LOGS / f"{label}.log"
    junit.unlink(missing_ok=True)
    args = ["--continue-on-collection-errors", *files]
    testcache.run_pytest_cached(python, tree, tree, junit, args, log)
    return read_junit_details(junit)


def reproducers(
    worktree: Path, base_tree: Path, patch: Patch, python: Path, label: str
) -> CheckResult:
    """The patch's reproducers (the fork's harness) before the change (at
    `base_tree`) and with it: the PR's before/after figures."""
    test_ids = patch.reproducers()
    if not test_ids:
        return CheckResult([], "")
    LOGS.mkdir(parents=True, exist_ok=True)
    verdicts = {
        kind: reproducer_verdicts(
            python,
            tree,
            test_ids,
            ROOT,
            LOGS / f"{label}-reproducers-{kind}.xml",
            LOGS / f"{label}-reproducers-{kind}.log",
            testcache.run_pytest_cached,
        )
        for kind, tree in (("before", base_tree), ("after", worktree))
    }
    before, after = verdicts["before"], verdicts["after"]
    problems = [
        f"reproducer {t} {after[t].state} on the branch: {after[t].message}"
        for t in test_ids
        if after[t].state != "passes"
    ]
    failing = [t for t in test_ids if before[t].state == "fails"]
    if not failing:
        problems.append("no reproducer fails before the change: they prove nothing")
    figures = [
        "| reproducer (vllm-fork's harness) | before this change | with it |",
        "| --- | --- | --- |",
    ]
    for t in test_ids:
        b, a = before[t], after[t]
        said = f"{b.state}: `{_cell(b.message)}`" if b.message else b.state
        figures.append(
            f"| `{t.removeprefix('tests/reproducers/')}` | {said} | {a.state} |"
        )
    summary = (
        f"{len(test_ids)} reproducers of vllm-fork's harness: {len(failing)} "
        f"fail before this change, {sum(after[t].state == 'passes' for t in test_ids)}"
        " pass with it"
    )
    return CheckResult(problems, summary, figures)


def _cell(text: str, limit: int = 140) -> str:
    """`text` fit for a Markdown table cell in backticks."""
    text = text.replace("|", "/").replace("`", "'")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def base_worktree(worktree: Path, base: str) -> Iterator[Path]:
    """`base` checked out beside `worktree`, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="vllm-fork-export-base-") as tmp:
        base_tree = Path(tmp) / "base"
        git(worktree, "worktree", "add", "-q", "--detach", base_tree, base)
        try:
            yield base_tree
        finally:
            run(
                ["git", "-C", worktree, "worktree", "remove", "--force", base_tree],
                check=False,
            )


def slow_checks(
    worktree: Path, base: str, patch: Patch, series: Series, python: Path, label: str
) -> list[CheckResult]:
    """mypy, the tests and the reproducers; one that cannot run (no network
    for the mypy environment, say) is a problem, and the others still run."""
    results = []
    with base_worktree(worktree, base) as base_tree:
        for name, check in (
            ("mypy", lambda: mypy(worktree, base)),
            (
                "tests",
                lambda: tests(worktree, base, base_tree, series, python, label),
            ),
            (
                "reproducers",
                lambda: reproducers(worktree, base_tree, patch, python, label),
            ),
        ):
            try:
                results.append(check())
            except ForkError as e:
                results.append(CheckResult([f"{name}: {e}"], ""))
    return results
