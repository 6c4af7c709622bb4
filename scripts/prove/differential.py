#!/usr/bin/env python3
"""The differential oracle: the series does what the base does, except
where one of its patches says it does something else.

Runs generated traces (tests/harness/traces.py: requests with shared
prefixes and priorities, streaming-input sessions that idle holding KV,
aborts, preemption; no connector, or CPU offload eager or lazy; prefix
caching on and off; FCFS and priority; chunked prefill on and off; hybrid
groups) through vLLM's real scheduler on the base and on the series, one
worker process per tree, and compares them step by step: the requests
scheduled and their token counts, preemptions, finished requests, free GPU
blocks, running and waiting counts, requests waiting for KV, blocks loaded
and stored.

The first step where they differ must be one a patch of the series
declares (EFFECTS: which observables it may change, and when). Then the
comparison stops: what follows depends on that difference. Where the base
crashes or breaks an invariant, the comparison stops there too, and the
series must carry on to the end without either. Anything else fails, with
the trace, the first divergent step and both records there, and how to
replay it.

Liveness, whatever the steps: a declared effect permits a different
schedule, never less progress. Every request the base completes, the
series must complete (unless the base crashed), and a series that stalls
(nothing scheduled, nothing moving, requests left) where the base drains
fails. Two trace families run: "mixed" (the general traces above) and
"offload" (liveness scenarios of the CPU offload connector: prefixes
offloaded, the GPU prefix cache emptied, then arrivals that load them as
async loads; priority, hybrid, late loads). The report counts stalls on
the base and on the series, and the newest bare release's stalls on the
same traces (the goal: the series stalls no more than it; --no-newest
skips it). --all runs every release's series in turn and writes one
liveness table for them all.

    scripts/prove/differential.py [--series DIR | --all] [--seeds N]
                            [--first-seed K] [--series-tree DIR]

--series-tree compares the base with that tree in place of the series
(e.g. one built from an older series: `scripts/keep/apply.py --series OLD
--tree DIR`); its patches are taken to be those of --series.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.apply import apply_series, checkout_base
from lib.cli import main_guard, parser
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, ROOT, WORK, rel
from lib.series import Series, find_series, version_key
from lib.venv import release_venv, series_venv
from prove.declared_effects import EFFECTS, Effect, condition
from prove.worker_client import Worker

OUT = WORK / "differential"
PROVING = ROOT / "docs" / "proving.md"
LIVENESS_BEGIN = (
    '<!-- liveness table: make differential ARGS="--all --docs" writes this -->'
)
LIVENESS_END = "<!-- end of liveness table -->"
# Trace families (tests/harness/traces.py): general traces, the CPU offload
# connector's liveness scenarios, and both under async scheduling.
FAMILIES = ("mixed", "offload", "async-mixed", "async-offload")


@dataclass
class Verdict:
    seed: int
    kind: str  # same, explained, base-failed, FAILED
    detail: str = ""
    family: str = "mixed"
    # The engine stalled: requests left, nothing scheduled or moving.
    base_stalled: bool = False
    series_stalled: bool = False
    # The newest bare release on the same trace (None: not run).
    newest_stalled: bool | None = None


def progress_lost(base: dict[str, Any], series: dict[str, Any]) -> str:
    """What the base completed and the series did not, as a reason to fail
    ("" when the series made at least the base's progress). A base that
    crashed or broke an invariant promises nothing.

    Where both trees stall, which requests the stall catches depends on
    the schedule that led to it, which a declared effect may change: the
    series must then complete as many requests as the base, not the same
    ones (a series that stalls where the base drains, or that completes
    fewer, still fails)."""
    if base["crash"] or base["violation"]:
        return ""
    done, series_done = set(base.get("completed", ())), set(series.get("completed", ()))
    lost = sorted(done - series_done)
    if base.get("stalled") and series.get("stalled") and len(series_done) >= len(done):
        return ""
    if not lost and not (series.get("stalled") and not base.get("stalled")):
        return ""
    return (
        f"liveness: the series {'stalls' if series.get('stalled') else 'ends'} "
        f"with {', '.join(lost) or 'requests'} unfinished, which the base "
        f"completes ({len(base['steps'])} base steps, {len(series['steps'])} "
        "series steps)"
    )


def first_difference(base: list, series: list) -> tuple[int, set[str]] | None:
    for i, (b, s) in enumerate(zip(base, series, strict=False)):
        differ = {k for k in b if b[k] != s.get(k)}
        if differ:
            return i, differ
    if len(base) != len(series):
        return min(len(base), len(series)), {"ended"}
    return None


def compare(
    seed: int,
    trace: dict[str, Any],
    base: dict[str, Any],
    series: dict[str, Any],
    effects: list[Effect],
    family: str = "mixed",
) -> Verdict:
    verdict = step_verdict(seed, trace, base, series, effects)
    verdict.family = family
    verdict.base_stalled = bool(base.get("stalled"))
    verdict.series_stalled = bool(series.get("stalled"))
    if verdict.kind != "FAILED" and (lost := progress_lost(base, series)):
        verdict.kind, verdict.detail = "FAILED", lost
    return verdict


def same_crash(base: str | None, series: str | None) -> bool:
    """Both trees raised the same exception in the same function, with the
    same message: the release's own bug, which the series did not bring
    (line numbers differ where patches moved the code)."""
    if not base or not series:
        return False
    return re.sub(r":\d+ ", " ", base) == re.sub(r":\d+ ", " ", series)


def step_verdict(
    seed: int,
    trace: dict[str, Any],
    base: dict[str, Any],
    series: dict[str, Any],
    effects: list[Effect],
) -> Verdict:
    """The step-by-step comparison: same, explained, base-failed or FAILED."""
    if series["violation"] or (
        series["crash"] and not same_crash(base["crash"], series["crash"])
    ):
        return Verdict(
            seed, "FAILED", f"series: {series['crash'] or series['violation']}"
        )
    if series.get("race"):
        # The fake CUDA's checker: two accesses of a KV block nothing orders.
        return Verdict(
            seed, "FAILED", f"series: {series['races']} races, first: {series['race']}"
        )
    b_steps, s_steps = base["steps"], series["steps"]
    base_failed = base["crash"] or base["violation"]
    if base_failed:
        # The base's last step is where it broke: compare the steps before.
        b_steps = b_steps[:-1] if base["violation"] else b_steps
        s_steps = s_steps[: len(b_steps)]
    found = first_difference(b_steps, s_steps)
    if found is None:
        if base_failed:
            return Verdict(seed, "base-failed", base_failed)
        return Verdict(seed, "same")
    i, differ = found
    covering = [
        e
        for e in effects
        if condition(e.when, trace, b_steps, s_steps, i) and e.observables & differ
    ]
    covered = set().union(*(e.observables for e in covering)) if covering else set()
    if differ <= covered:
        names = ", ".join(sorted({e.patch for e in covering}))
        return Verdict(seed, "explained", f"step {i}: {sorted(differ)} by {names}")
    at = slice(max(0, i - 1), i + 1)
    return Verdict(
        seed,
        "FAILED",
        f"first divergence at step {i} in {sorted(differ - covered)}, which no "
        f"patch of the series declares here\n"
        f"      base   steps {at.start}..{i}: {json.dumps(b_steps[at])}\n"
        f"      series steps {at.start}..{i}: {json.dumps(s_steps[at])}",
    )


def trace_facts(trace: Any) -> dict[str, Any]:
    """The trace's configuration, and the step of its first session chunk
    (the conditions read both)."""
    chunks = [
        step
        for step, events in trace.events.items()
        if any(event[0] == "chunk" for event in events)
    ]
    return {**trace.cfg, "first_chunk_step": min(chunks, default=None)}


def series_effects(series: Series) -> list[Effect]:
    names = [p.name for p in series.patches()]
    return [e for e in EFFECTS if any(e.patch in n for n in names)]


def base_cache_dir(version: str) -> Path:
    """Where the base's results of each trace are kept for --cache-base:
    they depend only on the release and on the harness that runs them."""
    digest = hashlib.sha256(version.encode())
    for f in sorted((ROOT / "tests" / "harness").rglob("*.py")):
        digest.update(f.read_bytes())
    return OUT / "base-cache" / f"v{version}-{digest.hexdigest()[:12]}"


def read_cached(cache: Path | None, name: str) -> dict[str, Any] | None:
    """A trace's results kept in `cache`, or None."""
    path = cache / name if cache is not None else None
    return json.loads(path.read_text()) if path and path.exists() else None


def run_traces(
    python: Path,
    base_tree: Path,
    series_tree: Path,
    effects: list[Effect],
    seeds: range,
    timeout: float = 120,
    progress: bool = True,
    out: Path = OUT,
    base_cache: Path | None = None,
    families: tuple[str, ...] = FAMILIES,
    newest: tuple[Path, Path] | None = None,
    newest_cache: Path | None = None,
) -> tuple[list[Verdict], list[str]]:
    """Run the traces of `seeds` of each family on both trees; the verdicts
    and a report. The workers log into `out`. With `base_cache`, the base's
    results are read from there when present (and written there when not).
    `newest` (python, tree): the newest bare release, run on the same traces
    for its stall count; with `newest_cache`, its results are read from
    there when present (a run whose base is that release, given it as its
    `base_cache`, wrote them)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from harness.traces import FAMILIES as GENERATORS

    start = time.monotonic()

    def worker(name: str, tree: Path, py: Path = python) -> Worker:
        return Worker(
            py, tree, name, seeds.start, module="harness.trace_worker", log_dir=out
        )

    workers = {"series": worker("series", series_tree)}
    # The newest release's own series: its base is the newest bare release,
    # and a trace runs the same there twice (a third of the step's time).
    newest_is_base = newest is not None and newest[1].resolve() == base_tree.resolve()
    verdicts: list[Verdict] = []
    kinds: Counter[tuple[str, str]] = Counter()
    try:
        for family in families:
            for seed in seeds:
                name = f"{family}-{seeds.start}-{seed}.json"
                cached = read_cached(base_cache, name)
                if cached is None and "base" not in workers:
                    workers["base"] = worker("base", base_tree)
                newest_cached = None
                if newest is not None and not newest_is_base:
                    newest_cached = read_cached(newest_cache, name)
                    if newest_cached is None and "newest" not in workers:
                        workers["newest"] = worker("newest", newest[1], newest[0])
                skip = {"base": cached, "newest": newest_cached}
                for w_name, w in workers.items():
                    if skip.get(w_name) is None:
                        w.send(f"{seed} {family}")
                what = f"{family} trace {seed}"
                base = cached or workers["base"].receive(what, timeout)
                ser = workers["series"].receive(what, timeout)
                newest_stalled = None
                if newest_is_base:
                    newest_stalled = base["stalled"]
                elif newest is not None:
                    bare = newest_cached or workers["newest"].receive(what, timeout)
                    newest_stalled = bare["stalled"]
                if base_cache is not None and cached is None:
                    base_cache.mkdir(parents=True, exist_ok=True)
                    path = base_cache / name
                    tmp = path.with_suffix(f".{os.getpid()}")
                    tmp.write_text(json.dumps(base))
                    tmp.replace(path)  # whole or not at all: two runs may race
                trace = GENERATORS[family](seed)
                verdict = compare(seed, trace_facts(trace), base, ser, effects, family)
                verdict.newest_stalled = newest_stalled
                verdicts.append(verdict)
                kinds[(trace.connector, verdict.kind)] += 1
                if verdict.kind == "FAILED" and progress:
                    print(
                        f"FAILED {trace.describe()}\n    {verdict.detail}",
                        file=sys.stderr,
                    )
    finally:
        for w in workers.values():
            w.close()
    failed = [v for v in verdicts if v.kind == "FAILED"]
    lines = [
        f"{len(verdicts)} traces in {time.monotonic() - start:.0f}s",
        "",
        "| connector | same | explained | base failed | FAILED |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in ("none", "eager", "lazy"):
        row = [kinds[(c, k)] for k in ("same", "explained", "base-failed", "FAILED")]
        lines.append(f"| {c} | " + " | ".join(map(str, row)) + " |")
    lines += ["", *liveness_table(verdicts)]
    explained = Counter(
        v.detail.split(" by ", 1)[1] for v in verdicts if v.kind == "explained"
    )
    if explained:
        lines += ["", "Explained divergences, by the patches that declare them:"]
        lines += [f"- {n}: {k}" for k, n in explained.most_common()]
    if failed:
        lines += ["", f"{len(failed)} traces fail (a divergence no patch declares, "]
        lines[-1] += "or less progress than the base):"
        for v in failed:
            lines.append(f"- {GENERATORS[v.family](v.seed).describe()}")
            lines.append(f"    {v.detail}")
        lines.append(
            f"Replay one: PYTHONHASHSEED={seeds.start} PYTHONPATH=<tree>:tests "
            ".venv/bin/python -m harness.trace_worker --seed N --family F "
            "(base and series)"
        )
    return verdicts, lines


def liveness_table(verdicts: list[Verdict]) -> list[str]:
    """Stalls per trace family: on the base, on the series, and (when run)
    on the newest bare release."""
    head = "| family | traces | stalls on the base | stalls on the series |"
    rule = "| --- | --- | --- | --- |"
    newest = any(v.newest_stalled is not None for v in verdicts)
    if newest:
        head += " stalls on the newest bare release |"
        rule += " --- |"
    lines = ["Liveness (a stall: requests left, nothing scheduled or moving):"]
    lines += ["", head, rule]
    for family in dict.fromkeys(v.family for v in verdicts):
        mine = [v for v in verdicts if v.family == family]
        row = [
            family,
            len(mine),
            sum(v.base_stalled for v in mine),
            sum(v.series_stalled for v in mine),
        ]
        if newest:
            row.append(sum(bool(v.newest_stalled) for v in mine))
        lines.append("| " + " | ".join(map(str, row)) + " |")
    return lines


def summary(verdicts: list[Verdict]) -> str:
    """One line: how many traces were the same, explained, and so on, and
    the stalls (on the newest bare release too, where it ran)."""
    c = Counter(v.kind for v in verdicts)
    return (
        f"{len(verdicts)} traces: {c['same']} same, {c['explained']} diverge as "
        f"a patch declares, {c['base-failed']} where the base fails, "
        f"{c['FAILED']} failed; stalls: base "
        f"{sum(v.base_stalled for v in verdicts)}, series "
        f"{sum(v.series_stalled for v in verdicts)}"
        + (
            f", newest bare release {sum(bool(v.newest_stalled) for v in verdicts)}"
            if any(v.newest_stalled is not None for v in verdicts)
            else ""
        )
    )


def write_liveness_docs(
    table: list[str], seeds: int, families: tuple[str, ...], page: Path | None = None
) -> None:
    """Put `table` between the liveness markers of docs/proving.md, with
    the run that made it: by hand, a paste there once took rows of another
    table."""
    page = page or PROVING
    text = page.read_text()
    start, end = text.find(LIVENESS_BEGIN), text.find(LIVENESS_END)
    if start < 0 or end < start:
        raise ForkError(
            f"{rel(page)}: no liveness markers ({LIVENESS_BEGIN!r} ... "
            f"{LIVENESS_END!r}); put them back where the table goes"
        )
    run = (
        f'`make differential ARGS="--all --seeds {seeds} --docs"`, '
        f"{time.strftime('%Y-%m-%d')}, families {', '.join(families)}"
    )
    block = [LIVENESS_BEGIN, "", run, "", *table, ""]
    page.write_text(text[:start] + "\n".join(block) + text[end:])


def newest_bare_release() -> tuple[Path, Path]:
    """(python, tree) of the newest release, unpatched: its stalls on the
    same traces are the liveness goal."""
    newest = max(find_series(), key=lambda s: version_key(s.base().version))
    version = newest.base().version
    tree = WORK / f"v{version}" / "base"
    checkout_base(newest, tree)
    return release_venv(version, tree / "requirements" / "common.txt"), tree


def main() -> int:
    p = parser(__doc__, series="series to compare with its base")
    p.add_argument("--seeds", type=int, default=300, help="traces (default 300)")
    p.add_argument("--first-seed", type=int, default=0, help="first trace seed")
    p.add_argument(
        "--series-tree",
        type=Path,
        help="compare the base with this tree instead of the series' own",
    )
    p.add_argument(
        "--timeout", type=float, default=120, help="seconds one trace may take"
    )
    p.add_argument(
        "--out", type=Path, default=OUT, help=f"report and logs (default {rel(OUT)})"
    )
    p.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"trace families, comma-separated (default {','.join(FAMILIES)})",
    )
    p.add_argument(
        "--no-newest",
        action="store_true",
        help="do not run the newest bare release for its stall count",
    )
    p.add_argument(
        "--cache-base",
        action="store_true",
        help="keep the base's result of each trace and reuse it (it depends "
        "only on the release and the harness): for runs against many trees",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every release's series, one after the other, with one liveness "
        "table for them all (out/liveness.md)",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help=f"with --all: write the liveness table into {rel(PROVING)} too",
    )
    args = p.parse_args()
    families = tuple(f for f in args.families.split(",") if f)
    unknown = set(families) - set(FAMILIES)
    if unknown:
        p.error(f"unknown trace families {sorted(unknown)}: choose from {FAMILIES}")
    if args.all and args.series_tree:
        p.error("--all builds each release's series tree: drop --series-tree")
    if args.docs and not args.all:
        p.error("--docs writes the table of every release: add --all")
    out = args.out.resolve()
    newest = None if args.no_newest else newest_bare_release()
    every = sorted(find_series(), key=lambda s: version_key(s.base().version))
    chosen = every if args.all else [Series(args.series.resolve())]
    failed, rows = False, []
    for series in chosen:
        version = series.base().version
        dest = out / f"v{version}" if args.all else out
        verdicts = one_series(series, args, families, dest, newest)
        failed |= any(v.kind == "FAILED" for v in verdicts)
        rows += [f"| {version} | {row[2:]}" for row in liveness_table(verdicts)[4:]]
    if args.all:
        table = [
            "| release | family | traces | stalls on the base | stalls on the "
            "series |" + (" stalls on the newest bare release |" if newest else ""),
            "| --- | --- | --- | --- | --- |" + (" --- |" if newest else ""),
            *rows,
        ]
        (out / "liveness.md").write_text("\n".join(table) + "\n")
        print("\n".join(table) + f"\n\nwritten {rel(out / 'liveness.md')}")
        if args.docs:
            write_liveness_docs(table, args.seeds, families)
            print(f"written into {rel(PROVING)}")
    return 1 if failed else 0


def one_series(
    series: Series,
    args: Any,
    families: tuple[str, ...],
    out: Path,
    newest: tuple[Path, Path] | None,
) -> list[Verdict]:
    """Build the trees of `series` (unless --series-tree names its tree),
    run the traces on them, print and write the report."""
    version = series.base().version
    base_tree = WORK / f"v{version}" / "base"
    checkout_base(series, base_tree)
    if args.series_tree:
        series_tree = args.series_tree.resolve()
    else:
        series_tree = WORK / f"v{version}" / "series"
        apply_series(series, series_tree)
    python = series_venv(
        version,
        base_tree / "requirements" / "common.txt",
        series.dir == DEFAULT_SERIES,
    )
    print(
        f"differential: {args.seeds} traces from seed {args.first_seed}, "
        f"vLLM {version} base against {rel(series_tree)}",
        file=sys.stderr,
    )
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    verdicts, lines = run_traces(
        python,
        base_tree,
        series_tree,
        series_effects(series),
        seeds,
        args.timeout,
        out=out,
        base_cache=base_cache_dir(version) if args.cache_base else None,
        families=families,
        newest=newest,
    )
    lines[0] = f"Differential oracle, vLLM {version}: {lines[0]}"
    print("\n".join(lines))
    out.mkdir(parents=True, exist_ok=True)
    (out / "differential.md").write_text("\n".join(lines) + "\n")
    print(f"\n{summary(verdicts)}; written {rel(out / 'differential.md')}")
    return verdicts


if __name__ == "__main__":
    main_guard(main)
