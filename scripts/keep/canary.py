#!/usr/bin/env python3
"""Does the newest series still apply to upstream main, and is each patch still needed?

    make canary                                          # the stand-in's main
    make canary UPSTREAM=https://github.com/vllm-project/vllm.git REF=main
    make canary UPSTREAM=~/src/vllm REF=v0.34.0 SERIES=patches

Before a release exists, upstream main is where a patch first conflicts or
becomes redundant. The canary imports REF of UPSTREAM (default: main of the
stand-in history, make standin) as `make apply` imports a release, then
measures the series there exactly as the release matrix does
(scripts/keep/matrix.py): the reproducers on the bare ref, and each patch
replayed as `make rebase` would. It reports per patch:

- applies: still needed (its reproducers fail on the bare ref), and it
  applies (cleanly, 3-way, or with a recorded resolution);
- redundant: its reproducers pass on the bare ref (upstream fixed it), or its
  change is there already: time to drop it (make bisect-upstream finds the
  upstream commit to cite);
- conflicts: it does not apply: resolve it before the next release.

Then it runs the reproducers of the patches that applied with the series on
the ref: each must pass. Exit status 1 when a patch conflicts or one of
those reproducers fails, 0 otherwise (redundant patches are news, not a
failure). Writes .work/canary/canary.md and canary.json. The CI template
(ci/github-workflow.yml) runs it nightly against upstream main.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep import matrix
from keep.fetch import fetch_git_commit, upstream_repo
from keep.standin import STANDIN, upstream_or_standin
from lib.cli import main_guard, parser, say, step
from lib.paths import CACHE, ROOT, WORK, rel
from lib.series import Base, Series, find_series
from lib.testenv import reproducer_verdicts

OUT = WORK / "canary"
VERDICT = {
    "applies": "applies",
    "applies (3-way)": "applies",
    "applies (recorded resolution)": "applies",
    "upstream (fixed)": "redundant",
    "upstream (code)": "redundant",
    "conflict": "conflicts",
}
WHY = {
    "upstream (fixed)": "its reproducers pass on the bare ref",
    "upstream (code)": "its change is there already",
    "applies (3-way)": "3-way",
    "applies (recorded resolution)": "with a recorded resolution",
}


def canary(
    series: Series,
    source: str,
    ref: str,
    out: Path = OUT,
    repro_root: Path = ROOT,
    python: Path | None = None,
    cache: Path = CACHE,
    work: Path = WORK,
) -> dict:
    commit = fetch_git_commit(source, ref, upstream_repo(cache))
    # Named by its commit: main moves, and an import is never overwritten.
    base = Base(
        version=f"canary-{commit[:12]}", git_url=source, git_ref=ref, git_commit=commit
    )
    measured = matrix.build(
        series,
        [base.version],
        out=out,
        repro_root=repro_root,
        python=python,
        resolve=lambda version: base,
        cache=cache,
        work=work,
    )
    release = measured["releases"][base.version]
    patches = []
    for p in series.patches():
        cell = release["patches"][p.name]["state"]
        patches.append(
            {
                "patch": p.name,
                "verdict": VERDICT.get(cell, "conflicts"),
                "how": WHY.get(cell, ""),
                "reproducers": p.reproducers(),
            }
        )
    # The replay left the patches that applied on the scratch tree's branch.
    applied = [
        t for e in patches if e["verdict"] == "applies" for t in e["reproducers"]
    ]
    with_series = {}
    if applied:
        step(f"{len(applied)} reproducers with the series on {ref}")
        verdicts = reproducer_verdicts(
            Path(release["python"]),
            out / "tree",
            applied,
            repro_root,
            out / "logs" / "with-series.xml",
            out / "logs" / "with-series.log",
        )
        with_series = {t: v.state for t, v in verdicts.items()}
    for e in patches:
        e["with_series"] = {
            t: with_series[t] for t in e["reproducers"] if t in with_series
        }
    result = {
        "series": rel(series.dir),
        "upstream": source,
        "ref": ref,
        "commit": commit,
        "patches": patches,
    }
    (out / "canary.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "canary.md").write_text(markdown(result))
    return result


def failing(e: dict) -> list[str]:
    return [t for t, v in e["with_series"].items() if v != "passes"]


def ok(result: dict) -> bool:
    return all(
        e["verdict"] != "conflicts" and not failing(e) for e in result["patches"]
    )


def markdown(result: dict) -> str:
    lines = [
        f"# Canary: {result['series']}/ on {result['upstream']} {result['ref']} "
        f"({result['commit'][:12]})",
        "",
        "| patch | verdict | with the series |",
        "| --- | --- | --- |",
    ]
    for e in result["patches"]:
        verdict = e["verdict"] + (f" ({e['how']})" if e["how"] else "")
        runs = e["with_series"]
        if not runs:
            tested = ""
        elif failing(e):
            tested = f"{len(failing(e))} of {len(runs)} reproducers fail"
        else:
            tested = f"{len(runs)} reproducers pass"
        lines.append(f"| {e['patch']} | {verdict} | {tested} |")
    counts = {
        v: sum(e["verdict"] == v for e in result["patches"])
        for v in ("applies", "redundant", "conflicts")
    }
    lines += ["", ", ".join(f"{n} {v}" for v, n in counts.items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--upstream",
        help=f"path or URL of a vLLM clone (default: the stand-in, {rel(STANDIN)})",
    )
    p.add_argument(
        "--ref", default="main", help="branch, tag or commit (default: main)"
    )
    p.add_argument(
        "--series",
        type=Path,
        help="series to try (default: the newest release's, the closest to main)",
    )
    args = p.parse_args()
    series = Series(args.series.resolve()) if args.series else find_series()[-1]
    source = upstream_or_standin(args.upstream)
    step(f"canary: {rel(series.dir)}/ on {source} {args.ref}")
    result = canary(series, source, args.ref)
    say("")
    print((OUT / "canary.md").read_text())
    return 0 if ok(result) else 1


if __name__ == "__main__":
    main_guard(main)
