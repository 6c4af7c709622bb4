#!/usr/bin/env python3
"""Turn each patch of the series into what an upstream pull request needs.

For every patch that is not already upstream, rebased onto an upstream ref
(default: main of vLLM on GitHub, or of a local clone given by --upstream):
  - a branch export/<patch> in the tree (default vllm/): one commit, the
    patch applied with `git am -3`, its message without the fork's trailers,
    authored and signed off (`Signed-off-by:`) by whoever runs export (git
    config user.name and user.email: vLLM's DCO check wants the author's
    sign-off), the patch's own author kept as `Co-authored-by:`; checked;
  - the commit as dist/export/<patch>.patch, and a draft PR description
    dist/export/<patch>.md (vLLM's template: purpose from the patch's
    message, the issue it fixes, the reproducer test and how to run it);
  - the checks vLLM's pre-commit and CI would make (export_checks.py): the
    DCO sign-off; ruff check and ruff format with the ref's own settings and
    the SPDX header of new files; mypy as the pre-commit hook runs it; the
    tests the patch adds under tests/ fail on the ref and pass on the branch,
    and tests/v1/core and tests/v1/simple_kv_offload (those vLLM's CI runs
    for the patch's files) lose no passing test (--no-tests skips mypy and
    the tests). Their results are kept in .work/test-results/ by the tested
    tree's content, the tests and the environment (lib/testcache.py): a
    base that patches share, a stacked patch's base and a second export are
    served from there (--fresh-tests runs everything again). Each patch's
    line "checked in ..." says how long its checks took.
By default it exports the newest release's series (the closest to upstream
main that there is) from .work/v<release>/series, onto main fetched from
GitHub; --upstream points at a clone of vLLM instead, and --onto at
another ref (upstream/v<release> exports onto the release, offline).
Patches whose Upstream-Status starts with "upstream" or "backport" (the fix
is in a later upstream release) are skipped with a line saying so.

Each patch goes alone onto the ref when it applies there: one PR each. One
that needs an earlier patch (0002 uses 0001's NoFreeBlocksError) is stacked
on it: export tries it on each earlier exported patch's commit, newest
first, then on all of them in series order, and the first that applies
wins. Its PR description says it depends on those PRs (named by patch file
and branch) and is to be merged after them; the summary says "stacked on".
The checks compare the branch with the commit's real parent (the stacked
one). --stack instead puts every patch on the previous ones, and also on
the skipped backports a patch needs (on a ref older than their fix).

Your branches are never overwritten: when export/<patch> exists with other
content, the new branch is export/<patch>-2 (or -3, ...) and export says so.
A patch that applies neither alone nor stacked is reported with the
commands to resolve it by hand; the others are still exported.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.apply import apply_series
from keep.refresh import format_patches
from lib import testcache
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, DEFAULT_TREE, DIST, WORK, fresh_output_dir, rel
from lib.proc import git, git_ok, run
from lib.series import Patch, Series, find_series, series_for_version
from lib.testcache import Stats
from lib.venv import TEST_REQS, VENV, ensure_venv, pip_install, release_venv
from ship import export_checks
from ship.export_pr import and_list, e2e_figures, pr_description
from ship.export_preflight import (
    check_identity,
    check_onto,
    check_patches,
    why_this_series,
)
from ship.export_stack import Exported, apply_one, stack_on_backports, stack_on_exported

# This module is the CLI and the loop over the series (`export_series`):
# the branches, the files and the checks. The PR text is made by export_pr,
# the commits (alone or stacked) by export_stack, the checks by
# export_checks.

BRANCH_PREFIX = "export/"


def stacked_line(result: Exported) -> str:
    """What the console says of a patch stacked on earlier exported ones."""
    under = result.stacked_on
    prs = "that PR" if len(under) == 1 else "their PRs"
    return (
        "stacked on "
        + and_list([f"{r.patch.name} ({r.branch})" for r in under])
        + f"; its PR text says it depends on {prs}"
    )


def patch_time(began: float, before: tuple[int, int]) -> str:
    """How long a patch's checks took, and how many of its test runs (and
    mypy) the cache served (lib/testcache.py)."""
    minutes, seconds = divmod(round(time.monotonic() - began), 60)
    served, ran = Stats.served - before[0], Stats.ran - before[1]
    return (
        f"checked in {minutes} min {seconds} s: {served} of {served + ran} "
        f"test and mypy runs served from {rel(testcache.CACHE_DIR)}/"
    )


def signoff_identity(tree: Path) -> str:
    """`Name <email>` of whoever runs export, from git's configuration."""
    return check_identity(tree)


def ensure_ruff() -> None:
    """ruff in .venv, at the version vLLM's pre-commit pins (see venv.py)."""
    if not (VENV / "bin" / "ruff").exists():
        spec = next(r for r in TEST_REQS if r.startswith("ruff"))
        step(f"installing {spec} into {rel(VENV)}")
        pip_install(VENV, ["-q", spec])


def resolve_onto(tree: Path, onto: str, upstream: str | None) -> str:
    """The commit to export onto: `onto` fetched from `upstream`, or a local ref."""
    if upstream is None and git_ok(tree, "rev-parse", "-q", "--verify", onto):
        return git(tree, "rev-parse", f"{onto}^{{commit}}")
    source = upstream or "https://github.com/vllm-project/vllm.git"
    if Path(source).expanduser().is_dir():
        # file:// so that --depth works: the tree needs the ref, not its history.
        source = Path(source).expanduser().resolve().as_uri()
    step(f"fetching {onto} from {source}")
    proc = run(
        ["git", "-C", tree, "fetch", "-q", "--no-tags", "--depth", "1", source, onto],
        check=False,
    )
    if proc.returncode != 0:
        raise ForkError(
            f"cannot fetch {onto!r} from {source}:\n{proc.stderr.strip()}\n"
            "Give --onto a branch or tag that exists there, and --upstream a "
            "local clone of vLLM or its URL."
        )
    return git(tree, "rev-parse", "FETCH_HEAD^{commit}")


def free_branch(tree: Path, name: str, commit: str) -> tuple[str, str]:
    """A branch name to put `commit` on that clobbers nothing, and a note."""
    branch = BRANCH_PREFIX + name
    n = 1
    while git_ok(tree, "rev-parse", "-q", "--verify", f"refs/heads/{branch}"):
        same_tree = git(tree, "rev-parse", f"{branch}^{{tree}}") == git(
            tree, "rev-parse", f"{commit}^{{tree}}"
        )
        same_msg = git(tree, "log", "-1", "--format=%B", branch) == git(
            tree, "log", "-1", "--format=%B", commit
        )
        if same_tree and same_msg:
            return branch, "unchanged"
        n += 1
        branch = f"{BRANCH_PREFIX}{name}-{n}"
    git(tree, "branch", branch, commit)
    note = ""
    if n > 1:
        note = (
            f"{BRANCH_PREFIX}{name} exists with other content and was kept; "
            f"this export is {branch}"
        )
    return branch, note


def by_hand(
    tree: Path, patch: Patch, onto_ref: str, onto: str, base: str, hints: list[str]
) -> str:
    """The problem of a patch that does not apply: how to resolve it by hand
    on `base` (a branch or commit), with `hints` on what else may help."""
    t, branch = rel(tree), BRANCH_PREFIX + patch.name.removesuffix(".patch")
    return (
        f"does not apply onto {onto_ref} ({onto[:12]}). Resolve by hand:\n"
        f"  git -C {t} checkout -b {branch} {base}\n"
        f"  git -C {t} am -3 {rel(patch.path)}\n"
        f"  (resolve, git am --continue, then as export does:)\n"
        f"  git -C {t} commit --amend --reset-author --signoff"
        + "".join(f"\n  ({h})" for h in hints)
    )


def export_series(
    series: Series,
    tree: Path,
    onto_ref: str,
    upstream: str | None,
    out: Path,
    only: list[str] | None = None,
    stack: bool = False,
    python: Path | None = None,
) -> list[Exported]:
    """Export each patch; `python` (an environment meeting the release's
    requirements) also runs the tests and mypy checks (export_checks)."""
    if not (tree / ".git").exists():
        raise ForkError(f"{rel(tree)}/ is not a git checkout: run `make apply` first")
    signer = signoff_identity(tree)
    patches = all_patches = series.patches()
    if only:
        patches = [p for p in patches if any(p.name.startswith(o) for o in only)]
        if not patches:
            raise ForkError(
                f"no patch in {rel(series.dir)}/ starts with {', '.join(only)}"
            )
    ensure_ruff()
    onto = resolve_onto(tree, onto_ref, upstream)
    say(f"    onto {onto_ref} = {onto[:12]}")
    fresh_output_dir(out, "upstream export")
    results: list[Exported] = []
    base_version = series.base().version
    wt = Path(tempfile.mkdtemp(prefix="vllm-fork-export-"))
    try:
        git(tree, "worktree", "add", "-q", "--detach", wt, onto)
        # Backports skipped so far: with --stack, a patch written on top of
        # one (the ref predates the upstream fix) is stacked on it.
        skipped: list[Patch] = []
        # The patches exported so far, with their commits: what a patch that
        # does not apply alone is stacked on (with --stack: all of them).
        exported: list[Exported] = []
        for patch in patches:
            result = Exported(patch)
            results.append(result)
            if patch.is_upstream():
                result.note = f"skipped: already upstream ({patch.upstream_status()})"
                say(f"    {patch.name}: {result.note}")
                skipped.append(patch)
                continue
            step(f"{patch.name}: {patch.subject()}")
            if not stack:
                git(wt, "checkout", "-q", "--detach", onto)
            # What the last patch's checks left (caches, logs) goes.
            git(wt, "clean", "-q", "-fdx")
            # `start` is the commit's real parent: the ref, or what the patch
            # is stacked on. The checks compare the branch with it.
            start = git(wt, "rev-parse", "HEAD")
            commit = apply_one(wt, patch, signer)
            if stack:
                result.stacked_on = list(exported)
            if commit is None and stack and skipped:
                start, commit = stack_on_backports(wt, patch, skipped, signer)
                if commit is not None:
                    result.note = (
                        "stacked on "
                        + ", ".join(p.name for p in skipped)
                        + f": upstream later, not in {onto_ref}; it needs them"
                    )
                    say(f"    {result.note}")
                    skipped = []
            if commit == start:
                result.problems.append(
                    f"changes nothing on {onto_ref} ({onto[:12]}): it is there "
                    "already (is --onto the fork's own branch or tag? export "
                    "onto upstream's, e.g. upstream/v<release> or main)"
                )
                continue
            if commit is None and not stack and exported:
                start, commit, result.stacked_on = stack_on_exported(
                    wt, onto, patch, exported, signer
                )
            if commit is None:
                hints = []
                if not stack and exported:
                    hints.append(
                        "nor does it apply stacked on the patches exported before it"
                    )
                if not stack and skipped:
                    hints.append(
                        "or try --stack: it also stacks a patch on the skipped "
                        "backports " + ", ".join(p.name for p in skipped)
                    )
                earlier = all_patches[: all_patches.index(patch)]
                if any(p not in patches and not p.is_upstream() for p in earlier):
                    hints.append(
                        "it may need an earlier patch that --patch leaves out: "
                        "export that one too"
                    )
                base = exported[-1].branch if stack and exported else onto[:12]
                result.problems.append(
                    by_hand(tree, patch, onto_ref, onto, base, hints)
                )
                continue
            result.commit = commit
            exported.append(result)
            if result.stacked_on:
                say(f"    {stacked_line(result)}")
            stem = patch.name.removesuffix(".patch")
            began, before = time.monotonic(), (Stats.served, Stats.ran)
            checks = [
                export_checks.dco(wt, commit, signer),
                export_checks.lint(wt, start),
            ]
            if python is not None:
                checks += export_checks.slow_checks(
                    wt, start, patch, series, python, stem
                )
            result.problems += [p for c in checks for p in c.problems]
            summaries = [c.summary for c in checks if not c.problems and c.summary]
            figures = [line for c in checks if c.figures for line in c.figures + [""]]
            figures += e2e_figures(patch, base_version)
            result.branch, note = free_branch(tree, stem, commit)
            result.note = "; ".join(filter(None, [result.note, note]))
            made = format_patches(wt, [commit], out, start=patch.number)
            desc = out / (made[0].stem + ".md")
            desc.write_text(
                pr_description(
                    patch,
                    git(wt, "log", "-1", "--format=%B", commit),
                    base_version,
                    onto,
                    not result.problems,
                    summaries,
                    figures,
                    [r.pr_name() for r in result.stacked_on],
                )
            )
            result.files = [made[0], desc]
            for line in [f"branch {result.branch}", *map(rel, result.files)]:
                say(f"    {line}")
            for summary in summaries:
                say(f"    ok: {summary}")
            if python is not None:
                say(f"    {patch_time(began, before)}")
    finally:
        run(["git", "-C", tree, "worktree", "remove", "--force", wt], check=False)
        shutil.rmtree(wt, ignore_errors=True)
    return results


def main() -> int:
    p = parser(__doc__)
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--series",
        type=Path,
        help="series directory (default: the newest release's, the closest "
        "to upstream main)",
    )
    which.add_argument(
        "--version",
        metavar="RELEASE",
        help="the series of this release (make export VERSION=0.28.0)",
    )
    p.add_argument(
        "--tree",
        type=Path,
        help="git checkout to make the branches in (default: vllm/ for "
        "patches/, else .work/v<release>/series, built if missing)",
    )
    p.add_argument(
        "--onto",
        default="main",
        help="upstream branch, tag or commit to rebase onto (default: main)",
    )
    p.add_argument(
        "--upstream",
        help="local clone of vLLM or its URL to fetch --onto from (default: "
        "GitHub; leave out to use a ref the tree already has)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DIST / "export",
        help="directory for the .patch and .md files (default: dist/export/)",
    )
    p.add_argument(
        "--patch",
        action="append",
        metavar="NNNN",
        help="export only the patches whose name starts with this (repeatable)",
    )
    p.add_argument(
        "--stack",
        action="store_true",
        help="put every patch on top of the previous ones (and on the skipped "
        "backports a patch needs); by default a patch goes alone onto the ref, "
        "stacked only on the earlier ones it needs",
    )
    p.add_argument(
        "--fresh-tests",
        action="store_true",
        help="run every test and mypy again instead of reading the results "
        "kept for the same tree in .work/test-results/ (and keep the new ones)",
    )
    p.add_argument(
        "--no-tests",
        action="store_true",
        help="skip the slow checks: mypy and the tests (base and branch)",
    )
    args = p.parse_args()
    if args.version:
        series = series_for_version(args.version)
    elif args.series:
        series = Series(args.series.resolve())
    else:
        series = find_series()[-1]
    say(why_this_series(series, bool(args.version or args.series)))
    tree, builds = args.tree, False
    if tree is None and series.dir == DEFAULT_SERIES:
        tree = DEFAULT_TREE
    elif tree is None:
        tree, builds = WORK / f"v{series.base().version}" / "series", True
    # Everything that can be checked is, before anything is downloaded or built.
    check_patches(series, args.patch)
    check_identity(tree)
    check_onto(series, tree, args.onto, args.upstream, builds)
    ensure_venv("build")
    if builds:
        apply_series(series, tree)
    python = None
    testcache.FRESH = args.fresh_tests
    if not args.no_tests:
        python = release_venv(
            series.base().version, tree.resolve() / "requirements" / "common.txt"
        )
    results = export_series(
        series,
        tree.resolve(),
        args.onto,
        args.upstream,
        args.out.resolve(),
        args.patch,
        args.stack,
        python,
    )
    failed = [r for r in results if r.problems]
    say("")
    for r in results:
        state = "FAILED" if r.problems else ("skipped" if not r.branch else "ok")
        say(f"{state:8s} {r.patch.name}" + (f"  {r.branch}" if r.branch else ""))
        notes = [stacked_line(r)] if r.stacked_on and r.branch else []
        notes += [r.note] if r.note and r.branch else []
        for line in notes + r.problems:
            say("         " + line.replace("\n", "\n         "))
    exported = sum(1 for r in results if r.branch)
    say(f"\n{exported} exported, {len(failed)} with problems, into {rel(args.out)}/")
    return 1 if failed else 0


if __name__ == "__main__":
    main_guard(main)
