#!/usr/bin/env python3
"""`make bench`: the allocator's speed, unpatched base against the series.

Builds .work/v<version>/{base,series} as `make test` does, starts one
benchmark worker per tree (scripts/prove/bench_worker.py, its tree on
PYTHONPATH) and runs every benchmark in both, alternating which tree goes
first, for --rounds rounds. Prints each tree's median time and the ratio
base/series: the median over the rounds of each round's ratio, with the
middle half of the rounds' ratios to show the noise. 1.00 means the same
speed, below 1 means the series is slower (the target is at least 0.98).
Timings only: nothing here fails on them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.apply import apply_series, checkout_base
from lib.cli import main_guard, parser, say
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, ROOT, WORK
from lib.series import Series
from lib.testenv import tree_env
from lib.venv import series_venv

WORKER = ROOT / "scripts" / "prove" / "bench_worker.py"
ANSWER = "BENCH "  # bench_worker.py's answers start with this
TARGET = 0.98


class Worker:
    """A bench_worker.py process for one tree."""

    def __init__(self, python: Path, tree: Path) -> None:
        self.tree = tree
        self.proc = subprocess.Popen(
            [str(python), str(WORKER)],
            cwd=ROOT,
            # One hash seed for both trees: dict and set layouts then match.
            env={**os.environ, **tree_env(tree), "PYTHONHASHSEED": "0"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, name: str) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER) :])["seconds"]
        raise ForkError(
            f"the benchmark worker for {self.tree} died on {name!r}: its error is above"
        )

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def list_benchmarks(python: Path, tree: Path) -> list[str]:
    out = subprocess.run(
        [str(python), str(WORKER), "--list"],
        cwd=ROOT,
        env={**os.environ, **tree_env(tree)},
        capture_output=True,
        text=True,
    )
    answers = [x for x in out.stdout.splitlines() if x.startswith(ANSWER)]
    if out.returncode != 0 or not answers:
        raise ForkError(f"cannot list the benchmarks:\n{out.stderr.strip()[-2000:]}")
    return json.loads(answers[0][len(ANSWER) :])


def main() -> int:
    p = parser(__doc__, series="series to time against its base")
    p.add_argument("--rounds", type=int, default=41, help="runs per tree (default 41)")
    p.add_argument(
        "--only", action="append", help="run benchmarks whose name contains this"
    )
    args = p.parse_args()
    if args.rounds < 1:
        raise ForkError("--rounds must be at least 1")
    series = Series(args.series.resolve())
    work = WORK / f"v{series.base().version}"
    base_tree, series_tree = work / "base", work / "series"
    checkout_base(series, base_tree)
    apply_series(series, series_tree)
    python = series_venv(
        series.base().version,
        base_tree / "requirements" / "common.txt",
        series.dir == DEFAULT_SERIES,
    )

    names = list_benchmarks(python, base_tree)
    if args.only:
        names = [n for n in names if any(o in n for o in args.only)]
        if not names:
            raise ForkError(f"no benchmark matches {args.only}")
    workers = {"base": Worker(python, base_tree), "series": Worker(python, series_tree)}
    times: dict[str, dict[str, list[float]]] = {
        n: {"base": [], "series": []} for n in names
    }
    try:
        for name in names:
            say(f"==> {name} ({args.rounds} rounds)")
            workers["base"].run(name)  # warm-up, not counted
            workers["series"].run(name)
            for r in range(args.rounds):
                order = ("base", "series") if r % 2 == 0 else ("series", "base")
                for kind in order:
                    times[name][kind].append(workers[kind].run(name))
    finally:
        for w in workers.values():
            w.close()

    width = max(len(n) for n in names)
    print(
        f"{'benchmark':<{width}}  {'base ms':>8}  {'series ms':>9}  "
        "ratio  (middle half of the rounds)"
    )
    for name in names:
        base, patched = times[name]["base"], times[name]["series"]
        # Each round measures both trees back to back, so a round's ratio
        # sees one state of the (shared, noisy) machine.
        ratios = sorted(b / p for b, p in zip(base, patched, strict=True))
        ratio = statistics.median(ratios)
        low, high = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        flag = "" if ratio >= TARGET else f"  below {TARGET}"
        print(
            f"{name:<{width}}  {statistics.median(base) * 1e3:8.1f}  "
            f"{statistics.median(patched) * 1e3:9.1f}  {ratio:5.3f}  "
            f"({low:.3f}-{high:.3f}){flag}"
        )
    print(
        f"\nCPU time, medians of {args.rounds} rounds; ratio = base/series, the "
        f"median of the rounds' ratios (target >= {TARGET})"
    )
    return 0


if __name__ == "__main__":
    main_guard(main)
