#!/usr/bin/env python3
"""`make test`: prove each series against its unpatched upstream base.

For every series (default: patches/ and any series under patches/v*/):
  1. build .work/v<version>/base (bare upstream) and .work/v<version>/series
     (base + patches + overlay), and the test environment .venv;
  2. run upstream's tests/v1/core and tests/v1/simple_kv_offload on both
     trees: a test that passes on the base must pass with the series;
  3. run tests/reproducers on both trees: every test a patch names in a
     `Reproducer:` trailer must fail on the base and pass with the series;
     the tests the ledger's probes name must pass with the series;
  4. the differential oracle (scripts/prove/differential.py) on a short run of
     generated traces: the series schedules as the base does, except where
     a patch declares otherwise;
  5. check the series is stable: refresh right after apply changes no byte;
  6. lint the files the series changes with vLLM's own ruff settings.
Then a short end-to-end run of the real `vllm serve` (scripts/prove/e2e.py
--short: seed 000 and a small load mix, on the default release's base and
series and the newest release's series). Then, once: the project's own
tests (tests/, with the first series' tree) and ruff on scripts/ and
tests/. Ends with a summary table; exits non-zero if any step failed. Logs
are in .work/logs/.

--slow (make test-slow) runs only the project's tests marked slow, e.g. the
patched wheel made from upstream's real 244 MB wheel.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.refresh import refresh_series
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import ROOT, WORK, rel
from lib.proc import git
from lib.proc import run as run_cmd
from lib.series import (
    TRACKED_PATHS,
    Series,
    default_and_newest,
    find_series,
    version_key,
)
from lib.testenv import count, read_junit, run_pytest
from lib.venv import VENV, ensure_venv, release_venv
from prove import differential as differential_oracle
from prove import e2e
from prove.release_trees import Trees, prepare

UPSTREAM_TESTS = [p for p in TRACKED_PATHS if p.startswith("tests/")]
REPRODUCERS = ROOT / "tests" / "reproducers"
# Traces per series in make test's differential step (seconds each; make
# soak runs many more).
DIFFERENTIAL_TRACES = 200
# pytest-xdist workers for the project tests (fewer where fewer cores).
PROJECT_TEST_WORKERS = 4
LOGS = WORK / "logs"
# The newest bare release's differential results, kept for one make test run
# (emptied when it starts: the harness may have changed since the last).
NEWEST_BARE_RESULTS = WORK / "differential" / "make-test-newest-bare"


@dataclass
class Result:
    name: str
    ok: bool
    detail: str
    seconds: float


def summarize(outcomes: dict[str, str]) -> str:
    c = count(outcomes)
    return (
        f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
        f"{c['skipped']} skipped"
    )


def both_trees(
    python: Path,
    trees: Trees,
    label: str,
    args: list[str],
    cwd_base: Path | None = None,
    pytest: Callable[..., int] = run_pytest,
) -> tuple[dict, dict]:
    """Run pytest on the base and patched trees at once (two cores); logs
    are LOGS/<label>-v<version>-<base|series>.*. `pytest` is run_pytest or
    one with its signature (make export's serves known results again)."""

    def one(kind: str, tree: Path) -> dict[str, str]:
        junit = LOGS / f"{label}-v{trees.version}-{kind}.xml"
        log = LOGS / f"{label}-v{trees.version}-{kind}.log"
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.unlink(missing_ok=True)
        pytest(python, tree, cwd_base or tree, junit, args, log)
        return read_junit(junit)

    with ThreadPoolExecutor(2) as pool:
        base = pool.submit(one, "base", trees.base)
        patched = pool.submit(one, "series", trees.patched)
        return base.result(), patched.result()


def upstream_tests(
    python: Path,
    trees: Trees,
    label: str = "upstream",
    paths: list[str] | None = None,
    pytest: Callable[..., int] = run_pytest,
) -> tuple[bool, str]:
    """`paths` (default: all of UPSTREAM_TESTS) on both trees: a test that
    passes on the base must pass on the other."""
    # A module that fails to collect must not stop the others from running.
    args = ["--continue-on-collection-errors", *(paths or UPSTREAM_TESTS)]
    base, patched = both_trees(python, trees, label, args, pytest=pytest)
    if not any(o == "passed" for o in base.values()) or not patched:
        return False, f"nothing passed on the base: see {rel(LOGS)}/{label}-*.log"
    regressions = sorted(
        t for t, o in base.items() if o == "passed" and patched.get(t) != "passed"
    )
    new_failing = sorted(
        t for t, o in patched.items() if t not in base and o in ("failed", "error")
    )
    detail = f"base: {summarize(base)}\nseries: {summarize(patched)}"
    bad = regressions + new_failing
    if bad:
        detail += f"\n{len(bad)} newly failing:\n" + "\n".join(f"  {t}" for t in bad)
    else:
        detail += "\nno test that passes on the base fails with the series"
    return not bad, detail


def reproducers(python: Path, trees: Trees) -> tuple[bool, str]:
    patches = trees.series.patches()
    if not patches:
        return True, "series has no patches"
    # A reproducer file belongs to the patches that name its tests: a series
    # for another release runs only its own patches' files (the others are
    # patches it does not carry, upstream there or not ported yet).
    files = sorted({t.split("::")[0] for p in patches for t in p.reproducers()})
    base, patched = both_trees(
        python,
        trees,
        "reproducers",
        ["--continue-on-collection-errors", *(files or [str(REPRODUCERS)])],
        cwd_base=ROOT,
    )
    problems, checked = [], 0
    named = set()
    for p in patches:
        ids = p.reproducers()
        if not ids:
            problems.append(f"{p.name}: names no Reproducer")
        for test_id in ids:
            named.add(test_id)
            checked += 1
            on_base, on_series = base.get(test_id), patched.get(test_id)
            if on_base != "failed" or on_series != "passed":
                problems.append(
                    f"{p.name}: {test_id}: base {on_base or 'not run'}, "
                    f"series {on_series or 'not run'} (want failed, passed)"
                )
    for test_id, outcome in sorted(patched.items()):
        if test_id not in named and outcome in ("failed", "error"):
            problems.append(f"{test_id} fails with the series")
    detail = (
        f"{checked} reproducer tests of {len(patches)} patches: "
        f"fail on the base, pass with the series ({len(files)} files)"
    )
    if problems:
        detail = "\n".join(problems)
    return not problems, detail


def ledger_probes(python: Path, trees: Trees) -> tuple[bool, str]:
    """The tests the ledger's probes name (docs/ledger.md) must pass or skip
    with the series, every parametrization of each, as the rows say: a
    release that behaves otherwise (a will-not row's limit that one release
    lifts) fails here, naming the test, rather than leaving the row wrong.
    Only the series is run: on the bare release the probes of carried rows
    fail by design."""
    from keep.ledger import load, probe_tests

    ids = probe_tests(load())
    if not ids:
        return True, "the ledger names no probe test"
    junit = LOGS / f"ledger-probes-v{trees.version}-series.xml"
    log = LOGS / f"ledger-probes-v{trees.version}-series.log"
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    args = ["--continue-on-collection-errors", *ids]
    run_pytest(python, trees.patched, ROOT, junit, args, log)
    outcomes = read_junit(junit)
    bad = []
    for test_id in ids:
        cases = {
            k: o
            for k, o in outcomes.items()
            if k == test_id or k.startswith(test_id + "[")
        }
        wrong = {k: o for k, o in cases.items() if o not in ("passed", "skipped")}
        if not cases or wrong:
            seen = ", ".join(f"{k.partition('::')[2]} {o}" for k, o in wrong.items())
            bad.append(f"{test_id}: {seen or 'not run'} with the series")
    if bad:
        return False, (
            f"ledger probes (log: {rel(log)}; rerun: make test-releases "
            f"VERSION={trees.version}):\n" + "\n".join(f"  {b}" for b in bad)
        )
    return True, f"{len(ids)} ledger probes pass with the series"


def differential(python: Path, trees: Trees) -> tuple[bool, str]:
    """A short run of the differential oracle (make soak runs a long one).
    The newest bare release's results are kept for this run only
    (NEWEST_BARE_RESULTS): the newest release's series, tested first, runs
    them as its base, and the other series read them for the liveness goal
    instead of running the same traces again (a third of their step)."""
    newest = differential_oracle.newest_bare_release()
    newest_is_base = newest[1].resolve() == trees.base.resolve()
    verdicts, lines = differential_oracle.run_traces(
        python,
        trees.base,
        trees.patched,
        differential_oracle.series_effects(trees.series),
        range(DIFFERENTIAL_TRACES),
        progress=False,
        base_cache=NEWEST_BARE_RESULTS if newest_is_base else None,
        # The liveness goal: stall no more than the newest bare release.
        newest=newest,
        newest_cache=NEWEST_BARE_RESULTS,
    )
    log = LOGS / f"differential-v{trees.version}.md"
    log.write_text("\n".join(lines) + "\n")
    ok = not any(v.kind == "FAILED" for v in verdicts)
    detail = differential_oracle.summary(verdicts)
    if not ok:
        detail += f" (see {rel(log)})\n" + "\n".join(lines[-12:])
    return ok, detail


def series_stable(trees: Trees) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "series"
        shutil.copytree(trees.series.dir, copy, ignore=shutil.ignore_patterns("v*"))
        changes = refresh_series(Series(copy), trees.patched)
    changed = [f"{k} {n}" for k, names in changes.items() for n in names]
    if changed:
        return False, "refresh after apply would change: " + ", ".join(changed)
    return True, "refresh after apply changes no byte"


def ruff(paths: list[str], cwd: Path) -> tuple[bool, str]:
    """ruff check and ruff format --check, with the settings that apply in cwd."""
    ruff_bin = str(VENV / "bin" / "ruff")
    files = run_cmd(
        [ruff_bin, "check", "--show-files", *paths], cwd=cwd, check=False
    ).stdout.split()
    if not files:
        return True, "no Python files"
    check = run_cmd([ruff_bin, "check", "--quiet", *paths], cwd=cwd, check=False)
    fmt = run_cmd(
        [ruff_bin, "format", "--check", "--quiet", *paths], cwd=cwd, check=False
    )
    out = (check.stdout + check.stderr + fmt.stdout + fmt.stderr).strip()
    ok = check.returncode == 0 and fmt.returncode == 0
    return ok, (f"{len(files)} files clean" if ok else out[-3000:])


def vllm_lint(trees: Trees) -> tuple[bool, str]:
    base = trees.series.base()
    files = git(
        trees.patched,
        "diff",
        "--name-only",
        "--diff-filter=d",
        base.tag,
        "HEAD",
        "--",
        "*.py",
    ).split()
    return ruff(files, trees.patched)


def project_tests(python: Path, trees: Trees, slow: bool = False) -> tuple[bool, str]:
    name = "project-slow" if slow else "project"
    junit, log = LOGS / f"{name}.xml", LOGS / f"{name}.log"
    junit.unlink(missing_ok=True)
    args = ["tests", f"--ignore={REPRODUCERS}", *(["-m", "slow"] if slow else [])]
    if not slow:
        # One worker per core, each test to whichever is free (a few files
        # hold most of the time); the tests build their trees under their
        # own tmp dirs, so workers share nothing but read-only caches. At
        # most PROJECT_TEST_WORKERS: each worker builds its own trees, and
        # on a large CI machine dozens would fill the disk for little gain.
        # The slow tests fill the shared download caches: one process.
        workers = min(len(os.sched_getaffinity(0)), PROJECT_TEST_WORKERS)
        args += ["-n", str(workers), "--dist", "worksteal"]
    code = run_pytest(python, trees.patched, ROOT, junit, args, log)
    outcomes = read_junit(junit)
    failed = sorted(t for t, o in outcomes.items() if o in ("failed", "error"))
    detail = summarize(outcomes)
    if failed:
        detail += "\n" + "\n".join(f"  {t}" for t in failed)
    ok = code == 0 and bool(outcomes)
    if not outcomes:
        detail = f"pytest exit {code}, no results: see {rel(log)}"
    return ok, detail


def e2e_short(all_trees: list[Trees], pythons: dict[str, Path]) -> tuple[bool, str]:
    """The real server: the default release's base and series, the newest
    release's series (make e2e runs every release and scenario)."""
    first, newest = all_trees[0], all_trees[-1]
    targets = [
        e2e.Target(first.series, "base", first.base, pythons[first.version]),
        e2e.Target(first.series, "series", first.patched, pythons[first.version]),
    ]
    if newest is not first and newest.version in pythons:
        targets.append(
            e2e.Target(newest.series, "series", newest.patched, pythons[newest.version])
        )
    # Two servers at a time where there are two cores (the short scenarios
    # are judged on outcomes; none is timed).
    jobs = min(2, len(os.sched_getaffinity(0)))
    ok, _, summary = e2e.run_targets(targets, short=True, jobs=jobs)
    return ok, "\n".join(summary) + f"\ntables: {rel(e2e.OUT)}/e2e-short.md"


class Report:
    """Runs the steps, prints each outcome, and keeps them for the table."""

    def __init__(self) -> None:
        self.results: list[Result] = []

    def run(self, name: str, fn: Callable[[], tuple]) -> Any:
        """Run a step: fn returns (ok, detail) or (ok, detail, value)."""
        step(name)
        start = time.monotonic()
        try:
            ok, detail, *value = fn()
        except ForkError as e:
            ok, detail, value = False, str(e), []
        self.results.append(Result(name, ok, detail, time.monotonic() - start))
        say(("    ok: " if ok else "    FAILED: ") + detail.replace("\n", "\n    "))
        return value[0] if value else None


def table(results: list[Result]) -> str:
    width = max(len(r.name) for r in results)
    lines = [
        f"{'step':<{width}}  result  {'time':>6}  detail",
        f"{'-' * width}  ------  ------  ------",
    ]
    for r in results:
        detail = r.detail.splitlines()
        first = detail[0] if detail else ""
        lines.append(
            f"{r.name:<{width}}  {'pass' if r.ok else 'FAIL':6}  "
            f"{r.seconds:5.0f}s  {first}"
        )
        lines += [f"{'':<{width}}  {'':6}  {'':6}  {d}" for d in detail[1:8]]
        if len(detail) > 8:
            lines.append(f"{'':<{width}}  {'':6}  {'':6}  ... see {rel(LOGS)}/")
    return "\n".join(lines)


def build_trees(series: Series) -> tuple[bool, str, Trees]:
    trees = prepare(series)
    return True, f"{rel(trees.base)}/ and {rel(trees.patched)}/", trees


def build_env(trees: Trees) -> tuple[bool, str, Path]:
    python = ensure_venv("test", trees.base / "requirements" / "common.txt")
    return True, rel(VENV), python


def release_env(trees: Trees) -> tuple[bool, str, Path]:
    """A series on another release is tested in an environment that meets
    that release's requirements (.venv, or one under .work/venvs/)."""
    common_txt = trees.base / "requirements" / "common.txt"
    python = release_venv(trees.version, common_txt)
    return True, rel(python.parent.parent), python


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--series",
        type=Path,
        action="append",
        help="series to test (repeatable; default: all)",
    )
    p.add_argument(
        "--slow",
        action="store_true",
        help="run only the project's tests marked slow (make test-slow)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="test every release's series in full (default: the default "
        "series and the newest release's; make test-releases proves the rest)",
    )
    p.add_argument(
        "--skip-upstream",
        action="store_true",
        help="skip upstream's tests (the slowest step)",
    )
    args = p.parse_args()
    series_list = find_series(args.series)
    if not args.series and not args.all:
        series_list, others = default_and_newest(series_list)
        if others:
            say(
                f"testing in full the series on {series_list[0].base().version} and "
                f"on the newest release; {len(others)} other releases' series "
                f"({', '.join(s.base().version for s in others)}) are proved by "
                "make test-releases"
            )
    LOGS.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(NEWEST_BARE_RESULTS, ignore_errors=True)
    report = Report()
    start = time.monotonic()

    all_trees = [
        report.run(f"trees v{s.base().version}", lambda s=s: build_trees(s))
        for s in series_list
    ]
    all_trees = [t for t in all_trees if t is not None]
    python = (
        report.run("environment", lambda: build_env(all_trees[0]))
        if all_trees
        else None
    )
    if python is not None and args.slow:
        first = all_trees[0]
        report.run("slow project tests", lambda: project_tests(python, first, True))
    elif python is not None:
        first = all_trees[0]
        pythons: dict[str, Path] = {}
        # The other releases' environments are mostly downloads and unpacking:
        # build them while the project tests use the cores (2 minutes of a
        # fresh clone's run).
        with ThreadPoolExecutor(1) as pool:
            envs = {
                t.version: pool.submit(release_env, t)
                for t in all_trees
                if t is not first
            }
            report.run("project tests", lambda: project_tests(python, first))
            report.run(
                "ruff (scripts, tests)", lambda: ruff(["scripts", "tests"], ROOT)
            )
            # Before any step that may want them (the differential compares
            # with the newest bare release).
            env_pythons = {
                v: report.run(f"environment v{v}", env.result)
                for v, env in envs.items()
            }
        # The newest release's series first: its differential runs the
        # newest bare release, whose results the other series then read.
        newest_v = max((t.version for t in all_trees), key=version_key)
        for t in sorted(all_trees, key=lambda t: t.version != newest_v):
            v = t.version
            py = python
            if t is not first:
                py = env_pythons[v]
                if py is None:
                    continue
            if not args.skip_upstream:
                report.run(
                    f"upstream tests v{v}", lambda t=t, py=py: upstream_tests(py, t)
                )
            report.run(f"reproducers v{v}", lambda t=t, py=py: reproducers(py, t))
            report.run(f"ledger probes v{v}", lambda t=t, py=py: ledger_probes(py, t))
            report.run(f"differential v{v}", lambda t=t, py=py: differential(py, t))
            report.run(f"series stable v{v}", lambda t=t: series_stable(t))
            report.run(f"ruff vLLM settings v{v}", lambda t=t: vllm_lint(t))
            pythons[v] = py
        report.run("e2e vllm serve (short)", lambda: e2e_short(all_trees, pythons))

    ok = bool(report.results) and all(r.ok for r in report.results)
    say("")
    say(table(report.results))
    say(
        f"\n{'PASSED' if ok else 'FAILED'} in {time.monotonic() - start:.0f}s "
        f"(logs in {rel(LOGS)}/)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    main_guard(main)
