#!/usr/bin/env python3
"""`make mutate`: is every hunk of the series load-bearing?

A test is as good as the mutants it kills. For each series (default: all),
each hunk of each patch is reverted alone on top of the whole series (the
patched tree with just that hunk undone) and the fast suite runs against
it: the series' reproducer files, the contract tests (CONTRACT_TESTS) and
the hypothesis state machines (tests/harness_tests/test_stateful.py). The
mutant is killed when a test fails, or, when none does, when the
differential oracle finds it changing what the base does where no patch
says so (40 traces). A hunk whose revert leaves the code's syntax tree
unchanged (comments, docstrings) is equivalent and not run; so is a hunk listed in
scripts/data/equivalent_hunks.toml, with the reason it cannot change
behaviour. A hunk that a later patch rewrote does not revert alone: it is
reported as not separable.

Then the operator mutants of the lines the series wrote (a condition
negated or loosened, a boundary moved by one, a loop that never runs), made
by Cosmic Ray and run against the same suite: see mutate_operators.py.

Then the semantic mutants: bugs written by hand, each as a contributor
could plausibly write it (a rollback that restores all but one field, an
event recorded on the wrong stream, a victim chosen by arrival instead of
priority), kept in scripts/data/semantic_mutants.toml with the bug each
stands for. Each is an exact text of the patched tree and its replacement,
for one release's series; a text not found exactly once in that tree is
an error naming the mutant, so the file moves with the patches. Operator
swaps and reverts cannot write these: they need a second edit, another
variable, the right wrong value.

Two mutants run at once (one git worktree each; --jobs). Writes
.work/mutate/mutate.md (mutate-<kinds>.md for fewer kinds, e.g.
mutate-semantic.md): per patch, killed / survived / equivalent / not
separable, and each survivor's diff; per series and kind, how many were
killed. The last line: `N of M mutants killed (P%)`, equivalent, not
separable and incompetent ones excluded. Exits non-zero below --target.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.apply import apply_series, checkout_base
from lib.cli import main_guard, parser
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, ROOT, WORK, rel
from lib.proc import git, git_ok, run
from lib.series import Series, default_and_newest, find_series
from lib.testenv import tree_env
from lib.venv import series_venv
from prove.mutate_operators import (
    DATA,
    OperatorMutant,
    differential_command,
    is_mutation_subject,
    load_claims,
    run_operator_mutants,
)
from prove.mutate_report import Hunk, Outcome, report
from prove.mutate_semantic import (
    SemanticMutant,
    mutated_text,
    semantic_of,
)

OUT = WORK / "mutate"
REPRODUCERS = ROOT / "tests" / "reproducers"
STATE_MACHINES = ROOT / "tests" / "harness_tests" / "test_stateful.py"
# Tests written to kill semantic mutants that no reproducer did: part of the
# fast suite of every kind.
MUTANT_TESTS = ROOT / "tests" / "reproducers" / "test_semantic_mutants.py"
# Contract tests of code more than one series carries in different patches,
# so no single series' trailers name them everywhere: the in-flight
# prefills' running total (0.20.2's admission gate and R4 from 0.23.0) is
# checked for what it counts by this file, R4's reproducer; without it the
# 0.20.2 series' candidate-in-flight arm of reserved_blocks went untested
# (two operator survivors, 2026-12-07). It skips where there is no total.
CONTRACT_TESTS = [
    ROOT / "tests" / "reproducers" / "test_reservation_is_counted_once.py"
]
# Hunks that cannot change behaviour, by patch subject fragment and a line
# the hunk adds or removes (exactly, indentation included), with the reason.
EQUIVALENT = load_claims(DATA / "equivalent_hunks.toml", ("patch", "line"))
# The hand-written mutants (make mutate --kinds semantic).
KINDS = ("hunks", "operators", "semantic")


def try_semantic(
    mutant: SemanticMutant,
    worktree: Path,
    python: Path,
    tests: list[str],
    series_dir: Path,
    baseline: OracleBaseline | None = None,
) -> SemanticMutant:
    if mutant.equivalent:
        mutant.state, mutant.detail = "equivalent", mutant.equivalent
        return mutant
    target = worktree / mutant.file
    before = target.read_text()
    after = mutated_text(mutant, before)
    if code_of(before) == code_of(after):
        raise ForkError(
            f"semantic mutant {mutant.id}: changes only comments or docstrings"
        )
    target.write_text(after)
    try:
        mutant.state, mutant.detail = run_suite(
            worktree, python, tests, series_dir, baseline
        )
    finally:
        target.write_text(before)
    return mutant


def hunks_of(tree: Path, base_tag: str) -> list[Hunk]:
    """Every hunk of every patch commit between the base and HEAD (the
    overlay commit excluded), in series order."""
    commits = git(tree, "rev-list", "--reverse", f"{base_tag}..HEAD").split()
    out: list[Hunk] = []
    for commit in commits:
        subject = git(tree, "log", "-1", "--format=%s", commit).strip()
        if subject.startswith("fork: overlay"):
            continue
        diff = git(tree, "show", "--format=", "-U3", "--no-color", commit)
        for file_diff in re.split(r"(?m)^(?=diff --git )", diff):
            if not file_diff.startswith("diff --git "):
                continue
            head, *bodies = re.split(r"(?m)^(?=@@ )", file_diff)
            path = re.search(r"(?m)^\+\+\+ b/(.+)$", head)
            if path is None or not is_mutation_subject(path[1]):
                continue
            for body in bodies:
                # git() strips the output's last newline; a patch needs it.
                text = head + body.rstrip("\n") + "\n"
                out.append(Hunk(subject, path[1], body.splitlines()[0], text))
    return out


# CPython 3.11's parser is not safe to run from two threads at once (it
# raised "AST constructor recursion depth mismatch" here): hunks are tried
# two at a time, so their parses take turns.
PARSE_LOCK = threading.Lock()


def code_of(source: str) -> str:
    """The syntax tree without docstrings and annotations (neither runs):
    what a revert must change to change behaviour."""
    with PARSE_LOCK:
        tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
        if isinstance(node, ast.arg):
            node.annotation = None
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body[0] = ast.Pass()
    return ast.dump(tree)


def try_one(
    hunk: Hunk,
    worktree: Path,
    python: Path,
    tests: list[str],
    series_dir: Path,
    baseline: OracleBaseline | None = None,
) -> Outcome:
    for (fragment, line), why in EQUIVALENT.items():
        changed = f"\n+{line}\n" in hunk.text or f"\n-{line}\n" in hunk.text
        if fragment in hunk.patch and changed:
            return Outcome(hunk, "equivalent", why)
    patch_file = worktree.parent / f"{worktree.name}.patch"
    patch_file.write_text(hunk.text)
    if not git_ok(worktree, "apply", "-R", "--check", str(patch_file)):
        return Outcome(hunk, "not separable", "a later patch changed these lines")
    target = worktree / hunk.file
    before = target.read_text()
    git(worktree, "apply", "-R", str(patch_file))
    try:
        # Reverting the hunk of a file the patch adds deletes the file.
        after = target.read_text() if target.exists() else ""
        if code_of(before) == code_of(after):
            return Outcome(hunk, "equivalent", "comments or docstrings only")
        state, detail = run_suite(worktree, python, tests, series_dir, baseline)
        return Outcome(hunk, state, detail)
    finally:
        target.write_text(before)


def failed_traces(report: str) -> set[str]:
    """The traces a differential.md report lists as failed ("mixed seed 3")."""
    _, _, failed = report.partition(" traces fail (")
    return set(re.findall(r"(?m)^- (\S+ seed \d+):", failed))


def pytest_command(python: Path, tests: list[str], *options: str) -> list[str]:
    return [
        str(python),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "fork_upstream_plugin",
        *options,
        *tests,
    ]


class OracleBaseline:
    """What fails on the unmutated series: the tests of the suite (run once,
    before any mutant) and the traces the differential oracle fails (run
    once per series when a mutant first needs it). A series in the making
    (a patch being amended, its new reproducer, a new trace family) can
    fail some itself; a mutant is killed only by a test or trace more, not
    by the ones the series already fails, which are deselected."""

    def __init__(self, series_dir: Path, tree: Path) -> None:
        self.series_dir, self.tree = series_dir, tree
        self.lock = threading.Lock()
        self.failed: set[str] | None = None
        self.failed_tests: list[str] = []

    def find_failed_tests(self, worktree: Path, python: Path, tests: list[str]) -> None:
        proc = subprocess.run(
            pytest_command(python, tests),
            cwd=ROOT,
            env={**os.environ, **tree_env(worktree)},
            capture_output=True,
            text=True,
        )
        self.failed_tests = re.findall(r"(?m)^(?:FAILED|ERROR) (\S+)", proc.stdout)
        if self.failed_tests:
            print(
                f"    the unmutated series fails {len(self.failed_tests)} tests of "
                f"the suite ({', '.join(self.failed_tests)}): deselected",
                file=sys.stderr,
            )

    def get(self) -> set[str]:
        with self.lock:
            if self.failed is None:
                out = self.tree.parent / f"{self.tree.name}.baseline-diff"
                subprocess.run(
                    differential_command(self.series_dir, str(self.tree), str(out)),
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                )
                report = out / "differential.md"
                self.failed = failed_traces(report.read_text())
                if self.failed:
                    print(
                        f"    the unmutated series fails {len(self.failed)} "
                        f"differential traces ({', '.join(sorted(self.failed))}): "
                        "not counted against mutants",
                        file=sys.stderr,
                    )
            return self.failed


def run_suite(
    worktree: Path,
    python: Path,
    tests: list[str],
    series_dir: Path,
    baseline: OracleBaseline | None = None,
) -> tuple[str, str]:
    """Run the fast suite, then (if it passes) the differential oracle, on
    the mutated `worktree`: ("killed", what failed) or ("survived", the
    suite's last line). With `baseline`, a trace the unmutated series fails
    too kills nothing."""
    deselect = [
        arg
        for t in (baseline.failed_tests if baseline else [])
        for arg in ("--deselect", t)
    ]
    proc = subprocess.run(
        pytest_command(python, tests, "-x", *deselect),
        cwd=ROOT,
        env={**os.environ, **tree_env(worktree)},
        capture_output=True,
        text=True,
    )
    last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    if proc.returncode != 0:
        failed = re.findall(r"(?m)^FAILED (\S+)", proc.stdout)
        return "killed", failed[0] if failed else last
    oracle = subprocess.run(
        differential_command(series_dir, str(worktree), str(worktree) + ".diff"),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if oracle.returncode != 0:
        verdict = (oracle.stdout.strip().splitlines() or ["no output"])[-1]
        report = Path(str(worktree) + ".diff") / "differential.md"
        if baseline is None or not report.exists():
            return "killed", f"differential oracle: {verdict}"
        new = failed_traces(report.read_text()) - baseline.get()
        if new:
            return "killed", f"differential oracle: {', '.join(sorted(new))} fail"
        verdict = "the oracle fails only the traces the unmutated series fails"
    return "survived", last if oracle.returncode == 0 else verdict


def mutate_series(
    series: Series,
    jobs: int,
    kinds: set[str],
    rerun_survivors: bool = False,
    only: list[str] | None = None,
    ids: list[str] | None = None,
) -> tuple[list[Outcome], list[OperatorMutant], list[SemanticMutant], list[str]]:
    version = series.base().version
    tree = WORK / f"v{version}" / "series"
    checkout_base(series, WORK / f"v{version}" / "base")
    apply_series(series, tree)
    python = series_venv(
        version, tree / "requirements" / "common.txt", series.dir == DEFAULT_SERIES
    )
    files = sorted(
        {t.split("::")[0] for p in series.patches() for t in p.reproducers()}
    )
    tests = [*files, str(STATE_MACHINES.relative_to(ROOT))]
    if MUTANT_TESTS.exists():
        tests.append(str(MUTANT_TESTS.relative_to(ROOT)))
    for contract in (str(t.relative_to(ROOT)) for t in CONTRACT_TESTS):
        if contract not in tests:
            tests.append(contract)
    hunks = hunks_of(tree, series.base().tag)
    if only:
        hunks = [h for h in hunks if any(f in h.patch for f in only)]
    semantic: list[SemanticMutant] = []
    if "semantic" in kinds:
        subjects = [p.subject() for p in series.patches()]
        semantic = semantic_of(version, subjects, only)
        if ids:
            semantic = [m for m in semantic if m.id in ids]
        # Every text is checked before any mutant runs: a stale one stops
        # the run at once, not an hour in.
        for m in semantic:
            mutated_text(m, (tree / m.file).read_text())
    work = OUT / f"v{version}"
    # The operator session is kept for --rerun-survivors; the rest goes.
    for old in work.glob("worktree*"):
        shutil.rmtree(old, ignore_errors=True)
    run(["git", "-C", tree, "worktree", "prune"], check=False)
    work.mkdir(parents=True, exist_ok=True)
    worktrees = []
    for i in range(jobs):
        wt = work / f"worktree{i}"
        git(tree, "worktree", "add", "--detach", "--force", str(wt), "HEAD")
        worktrees.append(wt)
    outcomes: list[Outcome] = []
    operators: list[OperatorMutant] = []
    free = list(worktrees)
    baseline = OracleBaseline(series.dir, tree)
    if ("hunks" in kinds and hunks) or semantic:
        baseline.find_failed_tests(worktrees[0], python, tests)
    try:
        with ThreadPoolExecutor(jobs) as pool:

            def one(hunk: Hunk) -> Outcome:
                wt = free.pop()
                try:
                    return try_one(hunk, wt, python, tests, series.dir, baseline)
                finally:
                    free.append(wt)

            todo = hunks if "hunks" in kinds else []
            for n, outcome in enumerate(pool.map(one, todo), 1):
                outcomes.append(outcome)
                print(
                    f"    [{n}/{len(hunks)}] {outcome.state:13} "
                    f"{outcome.hunk.patch[:48]}: {outcome.hunk.name}",
                    file=sys.stderr,
                )
        if semantic:
            print(f"==> semantic mutants of {rel(series.dir)}", file=sys.stderr)
            with ThreadPoolExecutor(jobs) as pool:

                def one_semantic(m: SemanticMutant) -> SemanticMutant:
                    wt = free.pop()
                    try:
                        return try_semantic(m, wt, python, tests, series.dir, baseline)
                    finally:
                        free.append(wt)

                for n, m in enumerate(pool.map(one_semantic, semantic), 1):
                    print(
                        f"    [{n}/{len(semantic)}] {m.state:10} {m.id}: {m.detail}",
                        file=sys.stderr,
                    )
        if "operators" in kinds:
            print(f"==> operator mutants of {rel(series.dir)}", file=sys.stderr)
            operators = run_operator_mutants(
                tree,
                series.base().tag,
                worktrees,
                python,
                tests,
                series.dir,
                work,
                rerun_survivors,
                only,
            )
    finally:
        for wt in worktrees:
            run(["git", "-C", tree, "worktree", "remove", "--force", wt], check=False)
    return (
        outcomes,
        operators,
        semantic,
        report(version, outcomes, operators, semantic),
    )


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--series",
        type=Path,
        action="append",
        help="series to mutate (repeatable; default: patches/ and the newest "
        "release's)",
    )
    p.add_argument("--jobs", type=int, default=2, help="mutants at once (default 2)")
    p.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help="comma-separated: hunks (each hunk reverted), operators (Cosmic "
        "Ray's operator mutants of the series' lines), semantic (the bugs "
        "written by hand in scripts/data/semantic_mutants.toml); default all",
    )
    p.add_argument(
        "--target", type=float, default=95.0, help="percent to kill (default 95)"
    )
    p.add_argument(
        "--rerun-survivors",
        action="store_true",
        help="operator mutants: run again only those that survived the last "
        "run of the same series (after adding tests)",
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="SUBJECT",
        help="mutants of the patches whose subject contains this only "
        "(repeatable), after changing a few patches",
    )
    p.add_argument(
        "--mutant",
        action="append",
        metavar="ID",
        help="semantic mutants: only the one with this id (repeatable), e.g. "
        "after adding the test that should kill it",
    )
    args = p.parse_args()
    # The default series and the newest release's, unless --series says.
    series_list = find_series(args.series)
    if not args.series:
        series_list = default_and_newest(series_list)[0]
    kinds = set(args.kinds.split(","))
    if not kinds or not kinds <= set(KINDS):
        raise ForkError(f"--kinds: some of {', '.join(KINDS)}, not {args.kinds!r}")
    start = time.monotonic()
    lines: list[str] = ["# Mutants of the series (make mutate)", ""]
    killed = counted = 0
    for series in series_list:
        print(f"==> mutants of {rel(series.dir)}", file=sys.stderr)
        outcomes, operators, semantic, part = mutate_series(
            series, args.jobs, kinds, args.rerun_survivors, args.only, args.mutant
        )
        lines += [*part, ""]
        states = [o.state for o in outcomes] + [m.state for m in operators]
        states += [m.state for m in semantic]
        killed += states.count("killed")
        counted += states.count("killed") + states.count("survived")
    if not counted:
        raise ForkError("no mutant ran")
    percent = 100 * killed / counted
    lines.append(f"Took {time.monotonic() - start:.0f}s.")
    lines.append(f"{killed} of {counted} mutants killed ({percent:.0f}%)")
    OUT.mkdir(parents=True, exist_ok=True)
    # A run of fewer kinds does not overwrite the report of all.
    chosen = [k for k in KINDS if k in kinds]
    name = "mutate.md" if len(chosen) == len(KINDS) else f"mutate-{'-'.join(chosen)}.md"
    (OUT / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if percent >= args.target else 1


if __name__ == "__main__":
    main_guard(main)
