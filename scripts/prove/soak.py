#!/usr/bin/env python3
"""`make soak`: the series under load and faults, against the unpatched base.

Runs every generated workload (tests/harness/workloads.py: the seed reports'
scenarios and random mixes of long prompts with shared prefixes, chunked
prefill, hybrid groups, tiny GPU and CPU pools, aborts, preemptions, late
transfers and a pool raced by a peer engine) on the base and on the series,
through vLLM's real scheduler, KV cache manager and SimpleCPUOffload
connector, checking the invariants after every step. Then it runs the
hypothesis state machines with a larger budget on the series, and the
differential oracle (scripts/prove/differential.py) on --traces traces.

Prints one table (also .work/soak/soak.md and soak.json): per workload and
tree, runs, steps, requests completed, preemptions, crashes (exception and
where), invariant violations, content-tag mismatches, stores not ordered
after compute, races (accesses of a KV block that nothing orders, the fake
CUDA's checker), CPU blocks lost, blocks leaked, requests left unfinished,
wall time and scheduler steps per second, and the series/base speed ratio
(requests served per scheduler second) where the base survives. One
worker process per tree; they take the seeds in turn, so each seed's speed
ratio is measured under one machine load.
Exits non-zero if the series crashes, violates an invariant or leaks. Same
seed, same workloads: --seed N picks another, --vary a random one (printed,
so a finding can be replayed).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.apply import apply_series, checkout_base
from lib.cli import main_guard, parser
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, ROOT, WORK, rel
from lib.series import Series
from lib.venv import series_venv
from prove import differential
from prove.worker_client import Worker, worker_env

WORKLOADS = [
    "seed000-hybrid-eager",
    "seed002-flush",
    "seed003-peer",
    "mixed-full-eager",
    "mixed-full-lazy",
    "mixed-hybrid-eager",
    "mixed-hybrid-lazy",
    "mixed-hybrid-peer",
    "async-mixed-full-eager",
    "async-mixed-hybrid-lazy",
    "async-stops-in-flight",
]
OUT = WORK / "soak"
PROBLEMS = (
    "crashed",
    "violation_steps",
    "content_violations",
    "unordered_stores",
    "races",
    "lost_cpu_blocks",
    "leaked_gpu_blocks",
    "leaked_cpu_blocks",
    "pinned_cpu_hits",
    "unfinished",
)
# Silent problems: the run goes on (used to tell which runs the base survived).
SILENT = ("unordered_stores", "races", "lost_cpu_blocks")


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"runs": len(runs), "crashed": 0, "crash": None}
    sites: dict[str, int] = {}
    # Every problem but a crash (counted above, with the first one) is summed.
    sums = (
        *("steps", "requests", "completed", "aborted", "preemptions"),
        *(p for p in PROBLEMS if p != "crashed"),
        *("wall_seconds", "scheduler_seconds"),
    )
    for r in runs:
        for key in sums:
            if r.get(key) is not None:
                total[key] = total.get(key, 0) + r[key]
        if r["crash"]:
            total["crashed"] += 1
            site = f"{r['crash']['type']} at {r['crash']['where']}"
            sites[site] = sites.get(site, 0) + 1
        if r.get("first_violation") and not total.get("first_violation"):
            total["first_violation"] = f"seed {r['seed']}: {r['first_violation']}"
    if sites:
        total["crash"] = "; ".join(f"{site} (x{n})" for site, n in sites.items())
    seconds = total.get("scheduler_seconds") or 0
    total["steps_per_second"] = round(total.get("steps", 0) / seconds) if seconds else 0
    return total


def fmt(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    return "-" if value is None else str(value)


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    cols = [
        ("workload", None),
        ("tree", None),
        ("runs", "runs"),
        ("steps", "steps"),
        ("completed", None),
        ("preempt", "preemptions"),
        ("crashed", "crashed"),
        ("crash", "crash"),
        ("violations", "violation_steps"),
        ("content", "content_violations"),
        ("unordered", "unordered_stores"),
        ("races", "races"),
        ("lost CPU", "lost_cpu_blocks"),
        ("leaked", None),
        ("unfinished", "unfinished"),
        ("wall s", "wall_seconds"),
        ("steps/s", "steps_per_second"),
    ]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for workload, trees in results.items():
        for tree, row in trees.items():
            cells = []
            for name, key in cols:
                if name == "workload":
                    cells.append(workload)
                elif name == "tree":
                    cells.append(tree)
                elif name == "completed":
                    aborted = row.get("aborted") or 0
                    cells.append(
                        f"{row.get('completed', 0)}/{row.get('requests', 0)}"
                        + (f" (+{aborted} aborted)" if aborted else "")
                    )
                elif name == "leaked":
                    cells.append(
                        f"{fmt(row, 'leaked_gpu_blocks')} GPU / "
                        f"{fmt(row, 'leaked_cpu_blocks')} CPU"
                    )
                elif key == "wall_seconds":
                    cells.append(f"{row.get(key, 0):.1f}")
                else:
                    cells.append(fmt(row, key))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def survived(run: dict[str, Any]) -> bool:
    """No crash, violation, leak or stuck request (silent problems allowed)."""
    return not run["crash"] and not any(
        run.get(k) for k in PROBLEMS if k not in SILENT and k != "crashed"
    )


Timings = dict[str, dict[str, list[tuple[int, float]]]]


def time_workloads(
    start_workers: Callable[[], dict[str, Worker]],
    workloads: list[str],
    seed: int,
    runs: int,
    scale: int,
    rounds: int,
    timeout: float,
    tick: Callable[[str, str], None],
) -> Timings:
    """Per workload, tree and seed: steps, and the least scheduler time over
    `rounds` runs without the checks. As with timeit's repeats, a slower
    round measures the machine, not the code. Each round has fresh worker
    processes, so no one process's luck (its memory layout) decides every
    round; the trees take each seed in turn, the first alternating."""
    best = {
        w: {name: [(0, float("inf"))] * runs for name in ("base", "series")}
        for w in workloads
    }
    for k in range(rounds):
        workers = start_workers()
        try:
            for workload in workloads:
                for i in range(runs):
                    names = list(workers)[:: 1 if (i + k) % 2 == 0 else -1]
                    for name in names:
                        r = workers[name].run(
                            workload, seed + i, scale, timeout, timing=True
                        )
                        if not r["crash"]:
                            seconds = min(
                                best[workload][name][i][1], r["scheduler_seconds"]
                            )
                            served = r["completed"] + r["aborted"]
                            best[workload][name][i] = (served, seconds)
                tick(workload, f"round {k + 1}/{rounds} done")
        finally:
            for w in workers.values():
                w.close()
    return best


def speed_ratios(timings: Timings) -> dict[str, dict[str, Any]]:
    """series/base requests served (completed or aborted) per scheduler
    second: over all seeds, and the median and quartiles of the per-seed
    ratios (their spread). Both trees serve one plan, so where both serve
    every request (the base must survive to be timed) this is the base's
    scheduler time over the series'. Not per scheduled token: a series
    that keeps more prefix hits or preempts less schedules fewer tokens for
    the same requests (mixed-hybrid-lazy, seed 4242: 5,928 against 6,400),
    and per token that saving read as an 8 % slowdown."""
    out = {}
    for workload, trees in timings.items():
        pairs = [
            (b, s)
            for b, s in zip(trees["base"], trees["series"], strict=True)
            if b[0] and s[0] and b[1] < float("inf") and s[1] < float("inf")
        ]
        if not pairs:
            continue
        per_seed = sorted((s[0] / s[1]) / (b[0] / b[1]) for b, s in pairs)
        q1, median, q3 = (
            statistics.quantiles(per_seed, n=4) if len(per_seed) > 1 else per_seed * 3
        )
        base_rate = sum(b[0] for b, _ in pairs) / sum(b[1] for b, _ in pairs)
        series_rate = sum(s[0] for _, s in pairs) / sum(s[1] for _, s in pairs)
        out[workload] = {
            "ratio": round(series_rate / base_rate, 3),
            "median": round(median, 3),
            "q1": round(q1, 3),
            "q3": round(q3, 3),
            "seeds": len(pairs),
        }
    return out


def same_work(base: dict[str, Any]) -> bool:
    """A base that loses CPU blocks skips the stores the series makes."""
    return not base.get("lost_cpu_blocks")


def speed_caveat(base: dict[str, Any]) -> str:
    if same_work(base):
        return ""
    return (
        f"; not the same work: the base loses {base['lost_cpu_blocks']} CPU "
        "blocks the series stores"
    )


SPEED_TARGET = 0.95  # within 5% of the base's requests per scheduler second


def speed_verdict(
    ratios: dict[str, dict[str, Any]], results: dict[str, dict[str, dict[str, Any]]]
) -> str:
    comparable = {
        w: r["median"] for w, r in ratios.items() if same_work(results[w]["base"])
    }
    if not comparable:
        return "No workload where the base does the same work to compare speed on."
    slow = [f"{w} ({r})" for w, r in comparable.items() if r < SPEED_TARGET]
    return f"Median within 5% of the base (>= {SPEED_TARGET}) on the same work: " + (
        "all of " + ", ".join(comparable) if not slow else "not on " + ", ".join(slow)
    )


def speed_lines(
    args: Any,
    ratios: dict[str, dict[str, Any]],
    results: dict[str, dict[str, dict[str, Any]]],
) -> list[str]:
    if not args.timing_rounds:
        return ["Speed not timed (--timing-rounds 0)."]
    return [
        ("CALIBRATION, the base timed against itself: " if args.calibrate else "")
        + f"Scheduler speed where the base survives every run: series/base "
        f"requests served per scheduler second, best of {args.timing_rounds} "
        f"runs per "
        f"seed and "
        f"tree without the checks; the median of the per-seed ratios "
        f"(quartiles; over all seeds together):",
        *(
            f"- {w}: {r['median']} ({r['q1']}-{r['q3']}; all seeds {r['ratio']})"
            + ("" if args.calibrate else speed_caveat(results[w]["base"]))
            for w, r in ratios.items()
        ),
        speed_verdict(ratios, results),
    ]


def series_problems(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    out = []
    for workload, trees in results.items():
        row = trees.get("series", {})
        for key in PROBLEMS:
            if row.get(key):
                out.append(
                    f"{workload}: {key} = {row[key]}"
                    + (f" ({row['crash']})" if key == "crashed" else "")
                )
    return out


def differential_run(
    python: Path, trees: dict[str, Path], series: Series, seeds: range
) -> tuple[bool, str]:
    """The differential oracle's long run: base and series step by step."""
    verdicts, lines = differential.run_traces(
        python,
        trees["base"],
        trees["series"],
        differential.series_effects(series),
        seeds,
        progress=False,
        # The liveness goal: stall no more than the newest bare release.
        newest=differential.newest_bare_release(),
    )
    (OUT / "differential.md").write_text("\n".join(lines) + "\n")
    ok = not any(v.kind == "FAILED" for v in verdicts)
    detail = differential.summary(verdicts)
    if not ok:
        detail += f" (see {rel(OUT / 'differential.md')})"
    return ok, detail


def stateful(python: Path, tree: Path) -> tuple[bool, str]:
    env = {**os.environ, **worker_env(tree), "HYPOTHESIS_PROFILE": "soak"}
    start = time.monotonic()
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/harness_tests/test_stateful.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    (OUT / "stateful.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return proc.returncode == 0, f"{tail} ({time.monotonic() - start:.0f}s)"


def progress_bar(total: int):
    state = {"done": 0}

    tty = sys.stderr.isatty()

    def show(label: str, inner: str = "") -> None:
        width = 30
        filled = width * state["done"] // total
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] "
            f"{state['done']}/{total} {label} {inner}"
        )
        if tty:
            sys.stderr.write("\r" + line.ljust(100))
        elif inner == "" or inner.endswith("done"):  # a log: a line per unit
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    return state, show


def main() -> int:
    p = parser(__doc__, series="series to soak")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--vary", action="store_true", help="use a random first seed")
    p.add_argument(
        "--runs", type=int, default=20, help="seeds per workload and tree (default 20)"
    )
    p.add_argument(
        "--scale",
        type=int,
        default=4,
        help="requests per run, as a multiple (default 4)",
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated workload names",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="time the base against itself in place of the series: the speed "
        "ratio's noise on this machine",
    )
    p.add_argument(
        "--timing-rounds",
        type=int,
        default=5,
        help="timing runs per seed and tree for the speed ratio (default 5)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120,
        help="seconds one run may take (default 120)",
    )
    p.add_argument(
        "--traces",
        type=int,
        default=2000,
        help="differential oracle traces, from the soak's seed (default 2000)",
    )
    args = p.parse_args()
    seed = random.randrange(1_000_000) if args.vary else args.seed
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise ForkError(
            f"unknown workloads: {', '.join(unknown)} (known: {', '.join(WORKLOADS)})"
        )

    series = Series(args.series.resolve())
    version = series.base().version
    trees = {
        "base": WORK / f"v{version}" / "base",
        "series": WORK / f"v{version}" / "series",
    }
    checkout_base(series, trees["base"])
    apply_series(series, trees["series"])
    python = series_venv(
        version,
        trees["base"] / "requirements" / "common.txt",
        series.dir == DEFAULT_SERIES,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    print(
        f"soak of {rel(series.dir)} (vLLM {version}): seed {seed}, {args.runs} "
        f"runs x scale {args.scale} per workload and tree",
        file=sys.stderr,
    )

    start = time.monotonic()
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    state, show = progress_bar(len(workloads) * args.runs)

    def start_workers(timing: bool = False) -> dict[str, Worker]:
        # --calibrate: the base timed against itself, as if it were the series.
        use = {**trees, "series": trees["base"]} if timing and args.calibrate else trees
        return {
            name: Worker(python, tree, name, seed, log_dir=OUT)
            for name, tree in use.items()
        }

    workers = start_workers()
    try:
        for workload in workloads:
            raw[workload] = {name: [] for name in trees}
            show(workload)
            for i in range(args.runs):
                # Alternate which tree goes first, so neither always runs
                # right after the other's garbage.
                order = list(workers) if i % 2 == 0 else list(workers)[::-1]
                for name in order:
                    raw[workload][name].append(
                        workers[name].run(workload, seed + i, args.scale, args.timeout)
                    )
                state["done"] += 1
                show(workload, f"seed {seed + i}")
            show(workload, "done")
    finally:
        for w in workers.values():
            w.close()
    sys.stderr.write("\n")

    # Speed is compared where the base survives every run (a stuck base
    # spins through cheap empty steps).
    timed = [w for w in workloads if all(survived(r) for r in raw[w]["base"])]
    print(f"timing {', '.join(timed) or 'nothing'}", file=sys.stderr)
    state, show = progress_bar(len(timed) * args.timing_rounds)

    def tick(workload: str, inner: str) -> None:
        state["done"] += 1
        show(workload, inner)

    timings = time_workloads(
        lambda: start_workers(timing=True),
        timed,
        seed,
        args.runs,
        args.scale,
        args.timing_rounds,
        args.timeout,
        tick,
    )
    sys.stderr.write("\n")
    results = {
        workload: {name: aggregate(runs) for name, runs in trees_runs.items()}
        for workload, trees_runs in raw.items()
    }
    ok_stateful, stateful_detail = stateful(python, trees["series"])
    print(f"differential oracle: {args.traces} traces", file=sys.stderr)
    ok_differential, differential_detail = differential_run(
        python, trees, series, range(seed, seed + args.traces)
    )

    ratios = speed_ratios(timings)
    problems = series_problems(results)
    if not ok_stateful:
        problems.append(f"hypothesis state machines: {stateful_detail}")
    if not ok_differential:
        problems.append(f"differential oracle: {differential_detail}")
    md = [
        f"Soak of {rel(series.dir)} on vLLM {version}, seed {seed}, "
        f"{args.runs} runs x scale {args.scale}, "
        f"{time.monotonic() - start:.0f}s",
        "",
        table(results),
        "",
        *speed_lines(args, ratios, results),
        "",
        f"Hypothesis state machines (soak budget) on the series: {stateful_detail}",
        "",
        f"Differential oracle (scripts/prove/differential.py): {differential_detail}",
    ]
    firsts = [
        f"- {w} on {t}: {row['first_violation']}"
        for w, ts in results.items()
        for t, row in ts.items()
        if row.get("first_violation")
    ]
    if firsts:
        md += ["", "First invariant violation per workload and tree:", *firsts]
    md += [
        "",
        "Series: "
        + ("no crash, no violation, no leak" if not problems else "; ".join(problems)),
    ]
    text = "\n".join(md)
    (OUT / "soak.md").write_text(text + "\n")
    (OUT / "soak.json").write_text(
        json.dumps(
            {
                "seed": seed,
                "runs": args.runs,
                "scale": args.scale,
                "results": results,
                "speed_ratio": ratios,
            },
            indent=1,
        )
    )
    print(text)
    return 1 if problems else 0


if __name__ == "__main__":
    main_guard(main)
