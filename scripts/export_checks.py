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
    of tests/v1/core and tests/v1/simple_kv_offload that passes on the base
    passes on the branch.
Each check returns the problems it found (none: it passed) and a line for
the PR description.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common import WORK, ForkError, git, rel, run, step
from run_tests import Trees, ruff, upstream_tests
from series import Series
from testenv import BROKEN_TYPES, exception_type, read_junit_details, run_pytest

SPDX_HEADER = "# SPDX-License-Identifier: Apache-2.0"
MYPY_HOOK_DEPS = re.compile(
    r"- id: mypy\b.*?additional_dependencies:\s*\[([^\]]*)\]", re.S
)
LOGS = WORK / "logs" / "export"


@dataclass
class CheckResult:
    problems: list[str]
    summary: str


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
        if SPDX_HEADER not in (worktree / f).read_text().splitlines()[:3]:
            problems.append(f"{f}: a new file needs vLLM's SPDX header ({SPDX_HEADER})")
    return CheckResult(problems, "ruff check and ruff format: clean; SPDX headers")


def mypy_hook_requirements(worktree: Path) -> list[str]:
    """The mypy hook's pinned mypy and additional dependencies."""
    config = worktree / ".pre-commit-config.yaml"
    m = MYPY_HOOK_DEPS.search(config.read_text()) if config.exists() else None
    if not m:
        raise ForkError(f"{config}: no mypy hook with additional_dependencies found")
    return [d.strip().strip("'\"") for d in m.group(1).split(",") if d.strip()]


def mypy_venv(requirements: list[str]) -> Path:
    """An environment holding just the hook's requirements (as pre-commit
    makes one), cached by their list."""
    key = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:12]
    venv = WORK / "venvs" / f"mypy-{key}"
    if not (venv / ".complete").exists():
        step(f"installing vLLM's mypy hook ({requirements[0]}) into {rel(venv)}")
        shutil.rmtree(venv, ignore_errors=True)
        run(["python3", "-m", "venv", str(venv)])
        run([str(venv / "bin" / "pip"), "install", "-q", *requirements])
        (venv / ".complete").write_text("\n".join(requirements) + "\n")
    return venv


def mypy(worktree: Path, base: str) -> CheckResult:
    files = changed_python_files(worktree, base, "d")
    if not files:
        return CheckResult([], "mypy: no Python file changed")
    venv = mypy_venv(mypy_hook_requirements(worktree))
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin"}
    proc = run(
        [str(venv / "bin" / "python"), "tools/pre_commit/mypy.py", "3.11", *files],
        cwd=worktree,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).strip()
        return CheckResult([f"mypy (vLLM's pre-commit hook):\n{out[-3000:]}"], "")
    return CheckResult(
        [], f"mypy as vLLM's pre-commit runs it: clean ({len(files)} files)"
    )


def new_test_files(worktree: Path, base: str) -> list[str]:
    return [
        f
        for f in changed_python_files(worktree, base, "AM")
        if f.startswith("tests/") and Path(f).name.startswith("test_")
    ]


def tests(
    worktree: Path, base: str, series: Series, python: Path, label: str
) -> CheckResult:
    """The patch's own tests and upstream's scheduler tests, base and branch."""
    added = new_test_files(worktree, base)
    if not added:
        return CheckResult(
            [
                "adds no test under vLLM's tests/: a reviewer running "
                "`pytest tests/v1/core` sees nothing new"
            ],
            "",
        )
    LOGS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-fork-export-base-") as tmp:
        base_tree = Path(tmp) / "base"
        git(worktree, "worktree", "add", "-q", "--detach", base_tree, base)
        try:
            for f in added:
                (base_tree / f).parent.mkdir(parents=True, exist_ok=True)
                (base_tree / f).write_text((worktree / f).read_text())
            on_branch = _run(python, worktree, added, f"{label}-branch")
            on_base = _run(python, base_tree, added, f"{label}-base")
            git(base_tree, "checkout", "-q", "--", ".")
            for f in added:
                if not git(base_tree, "ls-files", f):
                    (base_tree / f).unlink()
            trees = Trees(series, series.base().version, base_tree, worktree)
            regressions_ok, regressions = upstream_tests(
                python, trees, f"export/{label}"
            )
        finally:
            run(
                ["git", "-C", worktree, "worktree", "remove", "--force", base_tree],
                check=False,
            )
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
        if o == "error" or (o == "failed" and exception_type(m) in BROKEN_TYPES)
    ]
    if on_branch and not failing_on_base:
        problems.append("none of the new tests fails on the base: they prove nothing")
    if broken:
        problems.append(
            "on the base these fail before they test anything (an import or a "
            "name the patch adds: use it inside the test):\n  " + "\n  ".join(broken)
        )
    if not regressions_ok:
        problems.append(f"tests/v1/core, tests/v1/simple_kv_offload:\n{regressions}")
    summary = (
        f"{len(on_branch)} new tests ({', '.join(added)}): "
        f"{sum(o == 'passed' for o, _ in on_branch.values())} pass on the branch, "
        f"{len(failing_on_base)} fail on the base. tests/v1/core and "
        "tests/v1/simple_kv_offload: " + regressions.replace("\n", "; ")
    )
    return CheckResult(problems, summary)


def _run(python: Path, tree: Path, files: list[str], label: str) -> dict:
    junit, log = LOGS / f"{label}.xml", LOGS / f"{label}.log"
    junit.unlink(missing_ok=True)
    run_pytest(python, tree, tree, junit, files, log)
    return read_junit_details(junit)
