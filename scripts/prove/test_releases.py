#!/usr/bin/env python3
"""`make test-releases`: prove every release's series, one row per release.

For each series (patches/ and every patches/v<release>/; RELEASES=0.19.0,0.28.0
picks some), as `make test` does for the default and newest ones:
  1. build .work/v<release>/base (bare upstream) and .work/v<release>/series
     (base + patches + overlay);
  2. take a test environment that meets the release's requirements
     (.venv or one under .work/venvs/, shared by releases whose
     requirements it already meets);
  3. run the reproducers each patch names: each must fail on the bare
     release and pass with the series (and no other test of those files
     may fail with the series); and the tests the ledger's probes name
     (docs/ledger.md) must pass with the series, as their rows say;
  4. run upstream's tests/v1/core and tests/v1/simple_kv_offload on both
     trees: no test that passes on the base may fail with the series.
A release that fails does not stop the others. Prints one table (written
to .work/releases/releases.md and releases.json) and exits non-zero if any
release failed.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.release_table import carried
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import WORK, rel
from lib.series import Series, find_series, series_for_version, version_key
from prove.run_tests import (
    build_env,
    ledger_probes,
    prepare,
    release_env,
    reproducers,
    upstream_tests,
)

OUT = WORK / "releases"


@dataclass
class Row:
    """One release's verdict."""

    release: str
    series: str
    patches: str
    reproducers: str
    upstream: str
    environment: str
    seconds: float
    ok: bool
    problems: list[str]


def patch_numbers(series: Series) -> str:
    """The patches a series carries, by their number in the default series
    (so that rows compare across releases)."""
    numbers = carried(find_series()[0], series)
    return f"{len(numbers)}: " + " ".join(numbers) if numbers else "0"


def first_line(detail: str) -> str:
    return detail.splitlines()[0] if detail else ""


def upstream_summary(detail: str) -> str:
    """'base N passed / series M passed / K newly failing' from the detail
    of run_tests.upstream_tests."""
    counts = {}
    for line in detail.splitlines():
        for side in ("base", "series"):
            if line.startswith(f"{side}: "):
                counts[side] = line.split(": ", 1)[1].split(" passed")[0]
    newly = 0
    for line in detail.splitlines():
        if line.endswith("newly failing:"):
            newly = int(line.split()[0])
    return (
        f"base {counts.get('base', '?')} passed, series "
        f"{counts.get('series', '?')} passed, {newly} newly failing"
    )


def prove(series: Series, is_default: bool) -> Row:
    """Every check of one release; never raises for a failing check."""
    start = time.monotonic()
    version, numbers = rel(series.dir), "?"
    problems: list[str] = []
    repro, upstream, environment = "not run", "not run", ""
    try:
        version = series.base().version
        numbers = patch_numbers(series)
        trees = prepare(series)
        if is_default:
            _, environment, python = build_env(trees)
        else:
            _, environment, python = release_env(trees)
        ok, detail = reproducers(python, trees)
        repro = first_line(detail) if ok else "FAILED"
        if not ok:
            problems += detail.splitlines()
        ok, detail = ledger_probes(python, trees)
        repro += f"; {detail}" if ok else "; ledger probes FAILED"
        if not ok:
            problems += [line.strip() for line in detail.splitlines()[1:]]
        ok, detail = upstream_tests(python, trees)
        upstream = (
            upstream_summary(detail) if ok else "FAILED: " + (upstream_summary(detail))
        )
        if not ok:
            problems += [line for line in detail.splitlines() if line.startswith("  ")]
            problems += [first_line(detail)] if "nothing passed" in detail else []
    except ForkError as e:
        problems.append(str(e))
    return Row(
        release=version,
        series=rel(series.dir) + "/",
        patches=numbers,
        reproducers=repro,
        upstream=upstream,
        environment=environment,
        seconds=round(time.monotonic() - start, 1),
        ok=not problems,
        problems=problems,
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| release | result | patches | reproducers (bare: fail, series: pass) "
        "| upstream tests/v1/core + simple_kv_offload | environment | time |",
        "| --- | --- | --- | --- | --- | --- | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.release} | {'pass' if r.ok else 'FAIL'} | {r.patches} | "
            f"{r.reproducers.replace('|', '/')} | {r.upstream} | "
            f"`{r.environment}` | {r.seconds:.0f}s |"
        )
    return "\n".join(lines)


def run(
    all_series: list[Series],
    default: Series,
    prove_one: Callable[[Series, bool], Row] = prove,
    out: Path = OUT,
) -> list[Row]:
    """Prove each series in turn; write the table and the JSON."""
    rows = []
    for i, series in enumerate(all_series, 1):
        step(f"[{i}/{len(all_series)}] {rel(series.dir)}/")
        row = prove_one(series, series.dir == default.dir)
        say(
            f"    {'ok' if row.ok else 'FAILED'}: {row.reproducers}; "
            f"{row.upstream} ({row.seconds:.0f}s)"
        )
        for problem in row.problems[:20]:
            say(f"      {problem}")
        rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    (out / "releases.md").write_text(table(rows) + "\n")
    (out / "releases.json").write_text(
        json.dumps([asdict(r) for r in rows], indent=1) + "\n"
    )
    return rows


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--releases",
        help="comma-separated releases (default: every release with a series)",
    )
    args = p.parse_args()
    default = find_series()[0]
    if args.releases:
        wanted = [r.strip() for r in args.releases.split(",") if r.strip()]
        if not wanted:
            raise ForkError("--releases names no release")
        chosen = [series_for_version(r) for r in wanted]
    else:
        # By release, the default one in its place.
        chosen = sorted(find_series(), key=lambda s: version_key(s.base().version))
    start = time.monotonic()
    rows = run(chosen, default)
    failed = [r.release for r in rows if not r.ok]
    say("")
    say(table(rows))
    say(
        f"\n{len(rows) - len(failed)} passed, {len(failed)} failed: "
        f"{len(rows)} releases in {time.monotonic() - start:.0f}s"
        + (f" (failed: {', '.join(failed)})" if failed else "")
        + f"; table in {rel(OUT / 'releases.md')}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    main_guard(main)
