#!/usr/bin/env python3
"""`make mutate`: is every hunk of the series load-bearing?

A test is as good as the mutants it kills. For each series (default: all),
each hunk of each patch is reverted alone on top of the whole series (the
patched tree with just that hunk undone) and the fast suite runs against
it: the series' reproducer files and the hypothesis state machines
(tests/harness_tests/test_stateful.py). The mutant is killed when a test
fails, or, when none does, when the differential oracle finds it changing
what the base does where no patch says so (40 traces). A hunk whose revert
leaves the code's syntax tree unchanged (comments, docstrings) is
equivalent and not run; so is a hunk listed in
scripts/data/equivalent_hunks.toml, with the reason it cannot change
behaviour. A hunk that a later patch rewrote does not revert alone: it is
reported as not separable.

Then the operator mutants of the lines the series wrote (a condition
negated or loosened, a boundary moved by one, a loop that never runs), made
by Cosmic Ray and run against the same suite: see mutate_operators.py.

Two mutants run at once (one git worktree each). Writes .work/mutate/
mutate.md (mutate-hunks.md or mutate-operators.md for one kind): per
patch, killed / survived / equivalent / not separable, and each survivor's
diff; per series and kind, how many were killed. The last line:
`N of M mutants killed (P%)`, equivalent, not separable and incompetent
ones excluded. Exits non-zero below --target.
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
from dataclasses import dataclass
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

OUT = WORK / "mutate"
REPRODUCERS = ROOT / "tests" / "reproducers"
STATE_MACHINES = ROOT / "tests" / "harness_tests" / "test_stateful.py"
# Hunks that cannot change behaviour, by patch subject fragment and a line
# the hunk adds or removes (exactly, indentation included), with the reason.
EQUIVALENT = load_claims(DATA / "equivalent_hunks.toml", ("patch", "line"))


@dataclass
class Hunk:
    patch: str  # the patch's subject
    file: str
    header: str  # the hunk's @@ line
    text: str  # a patch holding just this hunk

    @property
    def name(self) -> str:
        return f"{self.file} {self.header.split('@@')[1].strip()}"


@dataclass
class Outcome:
    hunk: Hunk
    state: str  # killed, survived, equivalent, not separable
    detail: str = ""


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
    hunk: Hunk, worktree: Path, python: Path, tests: list[str], series_dir: Path
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
        if code_of(before) == code_of(target.read_text()):
            return Outcome(hunk, "equivalent", "comments or docstrings only")
        proc = subprocess.run(
            [
                str(python),
                "-m",
                "pytest",
                "-x",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "fork_upstream_plugin",
                *tests,
            ],
            cwd=ROOT,
            env={**os.environ, **tree_env(worktree)},
            capture_output=True,
            text=True,
        )
        last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
        if proc.returncode != 0:
            failed = re.findall(r"(?m)^FAILED (\S+)", proc.stdout)
            return Outcome(hunk, "killed", failed[0] if failed else last)
        oracle = subprocess.run(
            differential_command(series_dir, str(worktree), str(worktree) + ".diff"),
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if oracle.returncode != 0:
            verdict = (oracle.stdout.strip().splitlines() or ["no output"])[-1]
            return Outcome(hunk, "killed", f"differential oracle: {verdict}")
        return Outcome(hunk, "survived", last)
    finally:
        target.write_text(before)


def mutate_series(
    series: Series,
    jobs: int,
    kinds: set[str],
    rerun_survivors: bool = False,
    only: list[str] | None = None,
) -> tuple[list[Outcome], list[OperatorMutant], list[str]]:
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
    hunks = hunks_of(tree, series.base().tag)
    if only:
        hunks = [h for h in hunks if any(f in h.patch for f in only)]
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
    try:
        with ThreadPoolExecutor(jobs) as pool:

            def one(hunk: Hunk) -> Outcome:
                wt = free.pop()
                try:
                    return try_one(hunk, wt, python, tests, series.dir)
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
    return outcomes, operators, report(version, outcomes, operators)


def report(
    version: str, outcomes: list[Outcome], operators: list[OperatorMutant]
) -> list[str]:
    def killed(states: list[str]) -> str:
        n, m = states.count("killed"), states.count("killed") + states.count("survived")
        return f"{n} of {m} killed ({100 * n / m:.0f}%)" if m else "none run"

    return [
        f"## vLLM {version}",
        "",
        f"Hunk reverts: {killed([o.state for o in outcomes])}. "
        f"Operator mutants: {killed([m.state for m in operators])}.",
        "",
        *hunk_report(outcomes),
        "",
        *operator_report(operators),
    ]


def operator_report(operators: list[OperatorMutant]) -> list[str]:
    states = ("killed", "survived", "equivalent", "incompetent")
    lines = [
        "### Operator mutants (Cosmic Ray)",
        "",
        "| patch | mutants | " + " | ".join(states) + " |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for patch in dict.fromkeys(m.patch for m in operators):
        mine = [m for m in operators if m.patch == patch]
        counts = " | ".join(str(sum(m.state == s for m in mine)) for s in states)
        lines.append(f"| {patch} | {len(mine)} | {counts} |")
    for m in operators:
        if m.state == "survived":
            lines += ["", f"Survived: {m.patch}, {m.name}", "```diff"]
            body = m.diff.splitlines()
            lines += [d for d in body if not d.startswith(("---", "+++"))]
            lines.append("```")
    for state in ("equivalent", "incompetent"):
        listed = [m for m in operators if m.state == state]
        if listed:
            lines += ["", f"{state.capitalize()}:"]
            lines += [f"- {m.patch}, {m.name}: {m.detail}" for m in listed]
    return lines


def hunk_report(outcomes: list[Outcome]) -> list[str]:
    lines = [
        "### Hunks reverted alone",
        "",
        "| patch | hunks | killed | survived | equivalent | not separable |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    patches = list(dict.fromkeys(o.hunk.patch for o in outcomes))
    for patch in patches:
        mine = [o for o in outcomes if o.hunk.patch == patch]
        count = {
            s: sum(o.state == s for o in mine)
            for s in ("killed", "survived", "equivalent", "not separable")
        }
        lines.append(
            f"| {patch} | {len(mine)} | "
            + " | ".join(str(v) for v in count.values())
            + " |"
        )
    for o in outcomes:
        if o.state == "survived":
            lines += [
                "",
                f"Survived: {o.hunk.patch}, {o.hunk.name}",
                "```diff",
                o.hunk.text.split("\n@@", 1)[-1].join(["@@", ""]).rstrip(),
                "```",
            ]
    equivalent = [o for o in outcomes if o.state == "equivalent"]
    if equivalent:
        lines += ["", "Equivalent:"]
        lines += [f"- {o.hunk.patch}, {o.hunk.name}: {o.detail}" for o in equivalent]
    return lines


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
        default="hunks,operators",
        help="hunks (each hunk reverted), operators (Cosmic Ray's operator "
        "mutants of the series' lines), or both (default)",
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
    args = p.parse_args()
    # The default series and the newest release's, unless --series says.
    series_list = find_series(args.series)
    if not args.series:
        series_list = default_and_newest(series_list)[0]
    kinds = set(args.kinds.split(","))
    if not kinds or not kinds <= {"hunks", "operators"}:
        raise ForkError(f"--kinds: hunks and/or operators, not {args.kinds!r}")
    start = time.monotonic()
    lines: list[str] = ["# Mutants of the series (make mutate)", ""]
    killed = counted = 0
    for series in series_list:
        print(f"==> hunks of {rel(series.dir)}", file=sys.stderr)
        outcomes, operators, part = mutate_series(
            series, args.jobs, kinds, args.rerun_survivors, args.only
        )
        lines += [*part, ""]
        states = [o.state for o in outcomes] + [m.state for m in operators]
        killed += states.count("killed")
        counted += states.count("killed") + states.count("survived")
    if not counted:
        raise ForkError("no mutant ran")
    percent = 100 * killed / counted
    lines.append(f"Took {time.monotonic() - start:.0f}s.")
    lines.append(f"{killed} of {counted} mutants killed ({percent:.0f}%)")
    OUT.mkdir(parents=True, exist_ok=True)
    # A run of one kind does not overwrite the report of both.
    name = "mutate.md" if len(kinds) == 2 else f"mutate-{kinds.pop()}.md"
    (OUT / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if percent >= args.target else 1


if __name__ == "__main__":
    main_guard(main)
