#!/usr/bin/env python3
"""Find the upstream commit that fixed a patch's bug, by running its reproducers.

    make upstream-cut                       # first: the cut history
    make bisect-upstream PATCH=0008         # SERIES=patches/v<release> for another

On the cut history (.work/upstream/cut.git, see make upstream-cut):

1. The release tags are searched (a binary search) for the last one whose
   bare tree fails the patch's reproducers and the first where they pass:
   the bounds the release matrix shows. The series' own base must fail them
   (every patch's reproducers do there) and the newest tag must pass them,
   else there is nothing to bisect and it says so.
2. `git bisect run` walks the commits between the two, running the
   reproducers at each with the test environment of the release that passes
   (a commit where they cannot run, e.g. it imports a file the cut left out,
   is skipped: `git bisect skip`).
3. It prints the first commit where they pass, with its subject and PR
   number when the subject has one, its id in the history that was cut
   (filter-repo's commit map), the first release that contains it, and the
   Upstream-Status trailer to write:
       Upstream-Status: fixed upstream in <commit> (<PR>), first released in <release>

Each probe is logged under .work/upstream/bisect/<patch>/, the result
written to .work/upstream/bisect/<patch>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.upstream_cut import CUT
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import ROOT, WORK, rel
from lib.proc import git, git_ok, run
from lib.series import Patch, Series, version_key
from lib.testenv import reproducer_verdicts
from lib.venv import release_venv

OUT = WORK / "upstream" / "bisect"
# git bisect run: 0 = the old state (still broken), 1 = the new (fixed),
# 125 = cannot tell at this commit.
BROKEN, FIXED, SKIP = 0, 1, 125
SAID = {"passes": "pass", "fails": "fail", "broken": "cannot run"}


@dataclass
class Probe:
    """Runs a patch's reproducers at whatever `tree` has checked out."""

    tree: Path
    tests: list[str]
    logs: Path
    repro_root: Path = ROOT
    python: Path | None = None

    def verdict(self, label: str, python: Path | None = None) -> str:
        """ "passes", "fails" (one fails for the bug's reason) or "broken"."""
        py = python or self.python or self.environment()
        self.logs.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^\w.-]", "_", label)
        verdicts = reproducer_verdicts(
            py,
            self.tree,
            self.tests,
            self.repro_root,
            self.logs / f"{stem}.xml",
            self.logs / f"{stem}.log",
        )
        states = {v.state for v in verdicts.values()}
        if states == {"passes"}:
            return "passes"
        return "fails" if "fails" in states else "broken"

    def environment(self) -> Path:
        version = git(self.tree, "describe", "--tags", "--abbrev=0", check=False)
        return release_venv(
            version.removeprefix("v") or "unknown",
            self.tree / "requirements" / "common.txt",
        )


def find_patch(series: Series, number: str) -> Patch:
    for p in series.patches():
        if p.name.startswith(number.zfill(4)):
            if not p.reproducers():
                raise ForkError(f"{p.name} names no Reproducer: nothing to run")
            return p
    raise ForkError(f"no patch {number} in {rel(series.dir)}/")


def release_tags(tree: Path) -> list[str]:
    """The v<release> tags on the history of HEAD, oldest first."""
    tags = git(tree, "tag", "--list", "v*", "--merged", "HEAD").split()
    return sorted(tags, key=version_key)


def release_bounds(probe: Probe, tags: list[str], base_tag: str) -> tuple[str, str]:
    """(last tag that fails, first tag that passes), by a binary search
    from the series' own base (which must fail) to the newest tag."""
    if base_tag not in tags:
        raise ForkError(
            f"the cut history has no tag {base_tag} (the series' base): cut a "
            "history that holds it"
        )
    lo, hi = tags.index(base_tag), len(tags) - 1
    verdicts: dict[int, str] = {}

    def at(i: int) -> str:
        if i not in verdicts:
            git(probe.tree, "checkout", "-q", "--detach", tags[i])
            verdicts[i] = probe.verdict(tags[i])
            say(f"    {tags[i]}: the reproducers {SAID[verdicts[i]]}")
        return verdicts[i]

    if at(lo) != "fails":
        raise ForkError(
            f"the reproducers {SAID[verdicts[lo]]} on {tags[lo]}, the series' base; "
            f"they must fail there (see {rel(probe.logs)}/)"
        )
    if at(hi) != "passes":
        raise ForkError(
            f"the reproducers {SAID[verdicts[hi]]} on {tags[hi]}, the newest release "
            "tag of the cut: not fixed upstream there, nothing to bisect"
        )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid) == "passes":
            hi = mid
        else:
            lo = mid
    return tags[lo], tags[hi]


def original_commit(cut: Path, commit: str) -> str:
    """The id `commit` had in the history that was cut (filter-repo's map)."""
    commit_map = cut / "filter-repo" / "commit-map"
    if commit_map.is_file():
        for line in commit_map.read_text().splitlines()[1:]:
            old, new = line.split()
            if new == commit:
                return old
    return commit


def bisect(
    patch: Patch, base_tag: str, cut: Path = CUT, out: Path = OUT, **probe_args
) -> dict:
    if not (cut / "HEAD").exists():
        raise ForkError(
            f"no cut history in {rel(cut)}: run make upstream-cut first "
            "(UPSTREAM=<clone of vLLM>, or none for the stand-in)"
        )
    stem = patch.name[:4]
    tree = out / stem / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    tree.parent.mkdir(parents=True, exist_ok=True)
    run(["git", "clone", "-q", "--no-local", cut, tree])
    if not git_ok(tree, "rev-parse", "-q", "--verify", "HEAD"):
        raise ForkError(
            f"{rel(cut)} has no HEAD branch to walk: point its HEAD at the "
            f"branch to bisect (git -C {rel(cut)} symbolic-ref HEAD refs/heads/main)"
        )
    probe = Probe(tree, patch.reproducers(), out / stem / "logs", **probe_args)
    step(f"{patch.name}: release bounds on {rel(cut)}")
    broken_tag, fixed_tag = release_bounds(probe, release_tags(tree), base_tag)
    # Every step runs with the environment of the release that passes.
    git(tree, "checkout", "-q", "--detach", fixed_tag)
    python = probe.python or probe.environment()
    step(f"git bisect between {broken_tag} (fails) and {fixed_tag} (passes)")
    git(tree, "bisect", "start", "--term-old=broken", "--term-new=fixed")
    try:
        git(tree, "bisect", "fixed", fixed_tag)
        git(tree, "bisect", "broken", broken_tag)
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--probe",
            "--python",
            str(python),
            "--logs",
            str(probe.logs),
            "--repro-root",
            str(probe.repro_root),
            *(arg for t in patch.reproducers() for arg in ("--test", t)),
        ]
        log = run(["git", "-C", tree, "bisect", "run", *command], check=False)
        (probe.logs / "bisect-run.log").write_text(log.stdout + log.stderr)
        if not git_ok(tree, "rev-parse", "-q", "--verify", "refs/bisect/fixed"):
            raise ForkError(f"git bisect found nothing: see {rel(probe.logs)}/")
        first = git(tree, "rev-parse", "refs/bisect/fixed")
        ambiguous = "only 'skip'ped commits left" in log.stdout
    finally:
        git(tree, "bisect", "reset", check=False)
    subject = git(tree, "log", "-1", "--format=%s", first)
    pr = re.search(r"\(#(\d+)\)", subject)
    released = [
        t
        for t in release_tags(tree)
        if git_ok(tree, "merge-base", "--is-ancestor", first, t)
    ]
    result = {
        "patch": patch.name,
        "reproducers": patch.reproducers(),
        "fails_on": broken_tag,
        "passes_on": fixed_tag,
        "commit": original_commit(cut, first),
        "cut_commit": first,
        "subject": subject,
        "pr": f"#{pr[1]}" if pr else None,
        "first_release": released[0].removeprefix("v") if released else None,
        "ambiguous": ambiguous,
    }
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def trailer(result: dict) -> str:
    what = result["pr"] or result["subject"]
    return (
        f"Upstream-Status: fixed upstream in {result['commit'][:12]} ({what}), "
        f"first released in {result['first_release']}"
    )


def probe_main(args: argparse.Namespace) -> int:
    """One step of `git bisect run`, in the commit it checked out."""
    probe = Probe(Path.cwd(), args.test, args.logs, args.repro_root, args.python)
    head = git(probe.tree, "rev-parse", "--short=12", "HEAD")
    verdict = probe.verdict(head)
    say(f"    {head}: the reproducers {SAID[verdict]}")
    return {"passes": FIXED, "fails": BROKEN}.get(verdict, SKIP)


def main() -> int:
    p = parser(__doc__, series="series the patch is in")
    p.add_argument("--patch", help="the patch's number, e.g. 0008")
    p.add_argument("--cut", type=Path, default=CUT, help=f"default: {rel(CUT)}")
    # Used by git bisect run (one step), not by hand.
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--python", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--logs", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--repro-root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    p.add_argument("--test", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        return probe_main(args)
    if not args.patch:
        p.error("--patch is required (make bisect-upstream PATCH=<number>)")
    series = Series(args.series.resolve())
    patch = find_patch(series, args.patch)
    r = bisect(patch, series.base().tag.split("/")[-1], args.cut.resolve())
    print(
        f"{r['patch']}: reproducers fail on {r['fails_on']}, pass on {r['passes_on']}"
    )
    print(f"first fixed: {r['commit']} {r['subject']}")
    if r["ambiguous"]:
        print("  (commits around it were skipped: see the bisect log)")
    print(trailer(r))
    return 0


if __name__ == "__main__":
    main_guard(main)
