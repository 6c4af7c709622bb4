#!/usr/bin/env python3
"""`make soak`: the series under load and faults, against the unpatched base.

Runs every generated workload (tests/harness/workloads.py: the seed reports'
scenarios and random mixes of long prompts with shared prefixes, chunked
prefill, hybrid groups, tiny GPU and CPU pools, aborts, preemptions, late
transfers and a pool raced by a peer engine) on the base and on the series,
through vLLM's real scheduler, KV cache manager and SimpleCPUOffload
connector, checking the invariants after every step. Then it runs the
hypothesis state machines with a larger budget on the series.

Prints one table (also .work/soak/soak.md and soak.json): per workload and
tree, runs, steps, requests completed, preemptions, crashes (exception and
where), invariant violations, content-tag mismatches, stores not ordered
after compute, CPU blocks lost, blocks leaked, requests left unfinished,
wall time and scheduler steps per second, and the series/base speed ratio
where the base survives. Exits non-zero if the series crashes, violates an
invariant or leaks. Same seed, same workloads: --seed N picks another,
--vary a random one (printed, so a finding can be replayed).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from apply import apply_series, checkout_base
from common import DEFAULT_SERIES, ROOT, WORK, ForkError, main_guard, parser, rel
from series import Series
from testenv import tree_env
from venv import ensure_venv

WORKLOADS = [
    "seed000-hybrid-eager",
    "seed002-flush",
    "seed003-peer",
    "mixed-full-eager",
    "mixed-full-lazy",
    "mixed-hybrid-eager",
    "mixed-hybrid-lazy",
    "mixed-hybrid-peer",
]
OUT = WORK / "soak"
PROBLEMS = (
    "crashed",
    "violation_steps",
    "content_violations",
    "unordered_stores",
    "lost_cpu_blocks",
    "leaked_gpu_blocks",
    "leaked_cpu_blocks",
    "pinned_cpu_hits",
    "unfinished",
)
# Silent problems: the run goes on (used to tell which runs the base survived).
SILENT = ("unordered_stores", "lost_cpu_blocks")


def worker_env(tree: Path) -> dict[str, str]:
    env = tree_env(tree)
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "tests")
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    return env


def run_worker(
    python: Path,
    tree: Path,
    workload: str,
    seed: int,
    runs: int,
    scale: int,
    timeout: float,
    bar: Any,
) -> list[dict[str, Any]]:
    cmd = [
        str(python),
        "-m",
        "harness.soak_worker",
        "--workload",
        workload,
        "--seed",
        str(seed),
        "--runs",
        str(runs),
        "--scale",
        str(scale),
    ]
    log = OUT / f"{workload}-{tree.name}.log"
    result = OUT / f"{workload}-{tree.name}.json"
    with open(log, "w") as err, open(result, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, **worker_env(tree)},
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
        )
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        assert proc.stderr is not None
        for line in proc.stderr:
            err.write(line)
            if line.startswith("progress "):
                bar(line.split()[1])
        proc.wait()
        killer.cancel()
    if proc.returncode != 0:
        why = "timed out" if proc.returncode == -9 else f"exit {proc.returncode}"
        raise ForkError(
            f"soak worker {workload} on {tree.name} failed ({why}); see {rel(log)}"
        )
    return json.loads(result.read_text())


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"runs": len(runs), "crashed": 0, "crash": None}
    sites: dict[str, int] = {}
    sums = (
        "steps",
        "requests",
        "completed",
        "aborted",
        "preemptions",
        "violation_steps",
        "content_violations",
        "unordered_stores",
        "lost_cpu_blocks",
        "leaked_gpu_blocks",
        "leaked_cpu_blocks",
        "pinned_cpu_hits",
        "unfinished",
        "wall_seconds",
        "scheduler_seconds",
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


def speed_ratios(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float]:
    """series/base scheduler steps per second, where the base survived: no
    crash, violation, leak or stuck request in any run (a stuck base spins
    through empty steps, which are cheap)."""
    out = {}
    for workload, trees in results.items():
        base, series = trees.get("base"), trees.get("series")
        survived = base and not any(base.get(k) for k in PROBLEMS if k not in SILENT)
        if survived and series and base["steps_per_second"]:
            out[workload] = round(
                series["steps_per_second"] / base["steps_per_second"], 3
            )
    return out


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
        elif inner in ("", "done"):  # a log gets one line per unit started/done
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    return state, show


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--series",
        type=Path,
        default=DEFAULT_SERIES,
        help="series to soak (default: patches/)",
    )
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
        "--timeout",
        type=float,
        default=300,
        help="seconds one workload may take on one tree (default 300)",
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
    python = ensure_venv("test", trees["base"] / "requirements" / "common.txt")
    OUT.mkdir(parents=True, exist_ok=True)
    print(
        f"soak of {rel(series.dir)} (vLLM {version}): seed {seed}, {args.runs} "
        f"runs x scale {args.scale} per workload and tree",
        file=sys.stderr,
    )

    start = time.monotonic()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    state, show = progress_bar(len(workloads) * len(trees))
    for workload in workloads:
        for name, tree in trees.items():
            label = f"{workload} on {name}"
            show(label)
            runs = run_worker(
                python,
                tree,
                workload,
                seed,
                args.runs,
                args.scale,
                args.timeout,
                lambda k, label=label: show(label, k),
            )
            results.setdefault(workload, {})[name] = aggregate(runs)
            state["done"] += 1
            show(label, "done")
    sys.stderr.write("\n")
    ok_stateful, stateful_detail = stateful(python, trees["series"])

    ratios = speed_ratios(results)
    problems = series_problems(results)
    if not ok_stateful:
        problems.append(f"hypothesis state machines: {stateful_detail}")
    md = [
        f"Soak of {rel(series.dir)} on vLLM {version}, seed {seed}, "
        f"{args.runs} runs x scale {args.scale}, "
        f"{time.monotonic() - start:.0f}s",
        "",
        table(results),
        "",
        "Scheduler speed, series/base steps per second (where the base "
        "survives every run): "
        + (", ".join(f"{w} {r}" for w, r in ratios.items()) or "none"),
        "",
        f"Hypothesis state machines (soak budget) on the series: {stateful_detail}",
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
