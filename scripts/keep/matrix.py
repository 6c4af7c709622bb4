#!/usr/bin/env python3
"""The release matrix (`make matrix`): where each patch stands upstream.

For each release (default: 0.19.0 0.20.2 0.22.0 0.24.0 0.30.0 0.33.0) the
sdist is looked up on PyPI, fetched and checked out bare
(.work/v<version>/base), and two things are measured, by running them:

- each reproducer of the series on the bare release: "fails" (the bug is
  there), "passes" (fixed upstream), or "broken" (it could not exercise the
  code: a name it uses is gone; the message says which), in the release's own
  test environment (see `release_venv` in scripts/lib/venv.py);
- each patch replayed on the release in a scratch tree (.work/matrix/tree)
  exactly as `make rebase` would, without stopping: "applies", "applies
  (3-way)", "applies (recorded resolution)", "upstream (fixed)" (its
  reproducers pass there), "upstream (code)" (its change is there already),
  or "conflict" (then skipped, and the next patches are tried without it).

Then, computed without running anything more, where each bug of the ledger
(docs/ledger.md, scripts/data/ledger.toml) stands on each release: fixed
upstream, fixed by the fork (patch N: the release's own series carries it),
open, or "-" (the release does not have it).

Writes .work/matrix/matrix.md and matrix.json and prints the markdown.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.apply import checkout_release, fetch_base, init_tree
from keep.fetch import ensure_base, resolve_release
from keep.ledger import SeriesView, load, status
from keep.rebase_replay import (
    CLEAN,
    CONFLICT,
    MERGED,
    UPSTREAM,
    am_in_progress,
    build_old_series,
    replay_one,
)
from keep.resolutions import STORE, TREE_PORTS, gitdir, seed_conflicts, seed_ports
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import CACHE, ROOT, WORK, rel
from lib.proc import git, run
from lib.series import BASE_FILE, Base, Series
from lib.testenv import reproducer_verdicts
from lib.venv import release_venv

RELEASES = ["0.19.0", "0.20.2", "0.22.0", "0.24.0", "0.30.0", "0.33.0"]
OUT = WORK / "matrix"


def cell(state: str, detail: str) -> str:
    if state == CLEAN:
        return "applies"
    if state == MERGED:
        return (
            "applies (recorded resolution)"
            if "recorded" in detail
            else ("applies (3-way)")
        )
    if state == UPSTREAM:
        return "upstream (fixed)" if "reproducer" in detail else "upstream (code)"
    return state


def reset_scratch(tree: Path) -> None:
    """The scratch tree is the matrix's own: leave no am half done in it."""
    init_tree(tree)
    if am_in_progress(tree):
        run(["git", "-C", tree, "am", "--abort"], check=False)
    if git(tree, "rev-parse", "-q", "--verify", "HEAD", check=False):
        git(tree, "reset", "-q", "--hard")
    git(tree, "clean", "-q", "-fdx")


def replay_release(
    tree: Path, series: Series, base: Base, cache_repo: Path, verdicts: dict
) -> dict[str, dict]:
    fetch_base(tree, base, cache_repo)
    seed_conflicts(tree, STORE, time.time() - 60, cache_repo)
    git(tree, "checkout", "-q", "-B", f"matrix/v{base.version}", base.tag)
    results = {}
    for p in series.patches():
        outcome = replay_one(tree, p.path, p.reproducers(), verdicts, base.version)
        if outcome.state == CONFLICT:
            run(["git", "-C", tree, "am", "--abort"], check=False)
        results[p.name] = {
            "state": cell(outcome.state, outcome.detail),
            "detail": outcome.detail,
            "files": outcome.files,
        }
    return results


def build(
    series: Series,
    releases: list[str],
    out: Path = OUT,
    repro_root: Path = ROOT,
    python: Path | None = None,
    resolve=resolve_release,
    cache: Path = CACHE,
    work: Path = WORK,
) -> dict:
    """Measure every release; return the matrix as a dict (matrix.json)."""
    out.mkdir(parents=True, exist_ok=True)
    tree = out / "tree"
    reset_scratch(tree)
    own = series.base()
    fetch_base(tree, own, ensure_base(own, series.base_file, cache))
    build_old_series(tree, series)
    # The project's recorded resolutions, and nothing else (seeded again for
    # each release: a resolution is rebuilt from the upstream file it was
    # made on, once that release is imported).
    shutil.rmtree(gitdir(tree) / "rr-cache", ignore_errors=True)
    shutil.rmtree(gitdir(tree) / TREE_PORTS, ignore_errors=True)
    seed_ports(tree, STORE)
    ids = [t for p in series.patches() for t in p.reproducers()]
    matrix: dict = {
        "series": rel(series.dir),
        "series_base": own.version,
        "patches": [p.name for p in series.patches()],
        "reproducers": {t: p.name for p in series.patches() for t in p.reproducers()},
        "releases": {},
    }
    for i, version in enumerate(releases, 1):
        step(f"[{i}/{len(releases)}] vLLM {version}")
        seconds: dict[str, float] = {}
        t0 = time.monotonic()
        base = own if version == own.version else resolve(version)
        base_file = out / f"v{version}.{BASE_FILE}"
        base_file.write_text(base.to_toml())
        base_tree = work / f"v{version}" / "base"
        checkout_release(base, base_file, base_tree, cache)
        cache_repo = ensure_base(base, base_file, cache)
        seconds["fetch"] = time.monotonic() - t0
        t0 = time.monotonic()
        py = python or release_venv(version, base_tree / "requirements" / "common.txt")
        seconds["environment"] = time.monotonic() - t0
        t0 = time.monotonic()
        say(f"    {len(ids)} reproducer tests on the bare release ({rel(Path(py))})")
        logs = out / "logs"
        logs.mkdir(exist_ok=True)
        verdicts = reproducer_verdicts(
            py,
            base_tree,
            ids,
            repro_root,
            logs / f"v{version}.xml",
            logs / f"v{version}.log",
        )
        seconds["reproducers"] = time.monotonic() - t0
        t0 = time.monotonic()
        as_lists = {t: [v.state, v.message] for t, v in verdicts.items()}
        patches = replay_release(tree, series, base, cache_repo, as_lists)
        seconds["replay"] = time.monotonic() - t0
        for name, r in patches.items():
            say(f"    {name}: {r['state']}")
        matrix["releases"][version] = {
            "sdist_sha256": base.sdist_sha256,
            "python": str(py),
            "patches": patches,
            "reproducers": {
                t: {"verdict": v.state, "message": v.message}
                for t, v in verdicts.items()
            },
            "seconds": {k: round(v, 1) for k, v in seconds.items()},
        }
    matrix["ledger"] = ledger_statuses(releases)
    (out / "matrix.json").write_text(json.dumps(matrix, indent=1) + "\n")
    (out / "matrix.md").write_text(markdown(matrix))
    return matrix


def ledger_statuses(releases: list[str]) -> dict[str, dict[str, str]]:
    """Each ledger bug's standing on each release, from the ledger's data and
    the committed series (each release's own), not from this run."""
    view = SeriesView()
    return {
        bug.id: {v: status(bug, v, view) for v in releases}
        for bug in load(known=view.releases)
    }


def markdown(matrix: dict) -> str:
    releases = list(matrix["releases"])
    head = "| {} | " + " | ".join(releases) + " |"
    rule = "| --- |" + " --- |" * len(releases)
    lines = [
        f"# Release matrix of {matrix['series']}/ (series on {matrix['series_base']})",
        "",
        "## Patches, replayed on each release as `make rebase` would",
        "",
        head.format("patch"),
        rule,
    ]
    for name in matrix["patches"]:
        cells = [matrix["releases"][r]["patches"][name]["state"] for r in releases]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Reproducers on each bare release",
        "",
        "fails = the bug is there; passes = fixed upstream; broken = the test "
        "could not exercise the code there (see the notes).",
        "",
        head.format("reproducer"),
        rule,
    ]
    notes: dict[str, int] = {}
    for test_id, patch in matrix["reproducers"].items():
        cells = []
        for r in releases:
            v = matrix["releases"][r]["reproducers"][test_id]
            text = v["verdict"]
            if v["verdict"] not in ("fails", "passes"):
                note = f"{r}: {test_id}: {v['message']}"
                number = notes.setdefault(note, len(notes) + 1)
                text += f" [{number}]"
            cells.append(text)
        lines.append(
            f"| {patch[:4]} {test_id.split('/')[-1]} | " + " | ".join(cells) + " |"
        )
    if notes:
        lines += ["", "Notes:", ""]
        lines += [f"{n}. {note}" for note, n in notes.items()]
    if matrix.get("ledger"):
        lines += [
            "",
            "## The ledger on each release",
            "",
            "From docs/ledger.md and each release's committed series: fixed "
            "upstream, fixed by the fork (patch N), open, or - (the release "
            "does not have the bug).",
            "",
            head.format("bug"),
            rule,
        ]
        for bug, cells in matrix["ledger"].items():
            lines.append(f"| {bug} | " + " | ".join(cells[r] for r in releases) + " |")
    lines += [
        "",
        "## Time per release (seconds)",
        "",
        "| release | fetch | environment | reproducers | replay |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in releases:
        s = matrix["releases"][r]["seconds"]
        lines.append(
            f"| {r} | {s['fetch']:.0f} | {s['environment']:.0f} | "
            f"{s['reproducers']:.0f} | {s['replay']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = parser(__doc__, series="series to measure")
    p.add_argument(
        "--releases",
        default=",".join(RELEASES),
        help=f"comma-separated releases (default: {','.join(RELEASES)})",
    )
    args = p.parse_args()
    releases = [r.strip() for r in args.releases.split(",") if r.strip()]
    if not releases:
        raise ForkError("--releases names no release")
    start = time.monotonic()
    matrix = build(Series(args.series.resolve()), releases)
    sys.stdout.write(markdown(matrix))
    say(
        f"\nwritten {rel(OUT / 'matrix.md')} and {rel(OUT / 'matrix.json')} "
        f"in {time.monotonic() - start:.0f}s"
    )
    return 0


if __name__ == "__main__":
    main_guard(main)
