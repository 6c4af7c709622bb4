#!/usr/bin/env python3
"""`make bench`: the series' speed against its unpatched base, side by side.

For each series (by default the default release's, patches/, and the
newest release's) it builds .work/v<version>/{base,series} as `make test`
does and measures both trees in one run, in three parts:

  allocator  the allocator's hot paths (pool get/free, allocate_slots):
             each tree's median time and base/series, the median of the
             rounds' ratios (target at least 0.98);
  scheduler  vLLM's real Scheduler and KVCacheManager at scale, with and
             without the SimpleCPUOffload connector, on the project's
             harness (tests/harness/scale.py names the rows): a burst of 64,
             512, 4,096 and 10,000 requests; the scheduler's CPU per step
             (schedule() + update_from_output()) over the first --window
             steps, the total CPU to drain the burst (up to --drain-up-to
             requests; at larger sizes only the window is timed), series/base
             per round, and the exponent of ms/step against requests fitted
             from 512 to 10,000 (target: ratios at most 1.05); up to
             --count-up-to requests also the Python bytecodes the scheduler
             executes to drain one burst, series/base: a count, the same on
             any machine and under any load (harness.scale.Bytecodes);
  server     the real `vllm serve` with make e2e's model-free worker,
             driven by the openai client at a fixed concurrency
             (scripts/prove/bench_serve.py): requests/s and p50/p99
             latency, with and without the offload connector (target:
             series/base requests/s at least 0.98). Four servers start per
             release and their figures are wall time: keep the machine
             otherwise quiet. All three parts, both releases: about 17
             minutes on this project's 2-core build machine, 28 on a
             slower one (docs/speed.md).

One benchmark worker per tree (scripts/prove/bench_worker.py, its tree and
tests/ on PYTHONPATH) stays up for the allocator and scheduler parts; in
every round both trees run the same work at the same time, one per core,
so that a round's ratio sees one state of the machine and no core idles
(--serial: one after the other, the order alternating round by round, for
a machine with one core). The timed rounds are a minority of these parts
(engine set-up and the bytecode counts already ran on both trees at once):
on a slow 2-core machine they took 6.5-7 minutes a release at once,
against 9-10 alternating. Times are CPU time (time.process_time): time
spent waiting for a core is not counted, though other load on a shared
machine still makes them noisy. A scheduler round that uses up --limit CPU
seconds is cut, and what it measured shows as a lower
bound ('>'). Timings only: nothing here fails on them, a ratio past its
target is flagged. Worker logs go to .work/bench/.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.apply import apply_series, checkout_base
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, ROOT, WORK, rel
from lib.series import Series, default_and_newest, find_series
from lib.venv import series_venv
from prove.bench_report import Cell, Round, scale_table, serve_table
from prove.bench_serve import serve_part
from prove.worker_client import worker_env

WORKER = ROOT / "scripts" / "prove" / "bench_worker.py"
ANSWER = "BENCH "  # bench_worker.py's answers start with this
TARGET = 0.98
PARTS = ("allocator", "scheduler", "server")
DEFAULT_PARTS = ["allocator", "scheduler", "server"]
SIZES = (64, 512, 4096, 10_000)
KINDS = ("base", "series")
# Requests a scheduler round takes through at least, in bursts of the size
# measured (where the bursts are drained).
ROUND_REQUESTS = 1024
# A worker answer that takes longer than this is a hung worker.
ANSWER_SECONDS = 1800


class Worker:
    """A bench_worker.py process for one tree; its stderr (vLLM's log) goes
    to `log`."""

    def __init__(self, python: Path, tree: Path, log: Path) -> None:
        self.tree, self.log_path = tree, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [str(python), str(WORKER)],
            cwd=ROOT,
            # One hash seed for both trees: dict and set layouts then match.
            env={**os.environ, **worker_env(tree), "PYTHONHASHSEED": "0"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def send(self, line: str) -> None:
        """Ask without waiting (`receive` gets the answer), so that both
        trees' workers can do untimed work at once."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def receive(self, what: str) -> dict:
        assert self.proc.stdout is not None
        killer = threading.Timer(ANSWER_SECONDS, self.proc.kill)
        killer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(ANSWER):
                    return json.loads(line[len(ANSWER) :])
        finally:
            killer.cancel()
        raise ForkError(
            f"the benchmark worker for {rel(self.tree)} died on {what!r}: "
            f"see {rel(self.log_path)}"
        )

    def ask(self, line: str) -> dict:
        self.send(line)
        return self.receive(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def both(workers: dict[str, Worker], line: str) -> dict[str, dict]:
    """The same untimed command on both trees' workers at once."""
    for w in workers.values():
        w.send(line)
    return {kind: w.receive(line) for kind, w in workers.items()}


def alternate(r: int) -> tuple[str, str]:
    """Which tree goes first in round `r` (with --serial)."""
    return KINDS if r % 2 == 0 else KINDS[::-1]


def timed(workers: dict[str, Worker], line: str, r: int, serial: bool) -> dict:
    """A timed command on both trees' workers: at once, one on each core
    (both see the machine as it is then), or with `serial` one after the
    other, the order alternating round by round."""
    if not serial:
        return both(workers, line)
    return {kind: workers[kind].ask(line) for kind in alternate(r)}


def allocator_part(
    workers: dict[str, Worker], names: list[str], rounds: int, serial: bool
) -> list[str]:
    times: dict[str, dict[str, list[float]]] = {
        n: {k: [] for k in KINDS} for n in names
    }
    for name in names:
        step(f"allocator: {name} ({rounds} rounds)")
        both(workers, name)  # warm-up, not counted
        for r in range(rounds):
            for kind, answer in timed(workers, name, r, serial).items():
                times[name][kind].append(answer["seconds"])
    width = max(len(n) for n in names)
    out = [
        f"{'allocator benchmark':<{width}}  {'base ms':>8}  {'series ms':>9}  "
        "base/series  (middle half of the rounds)"
    ]
    for name in names:
        base, patched = times[name]["base"], times[name]["series"]
        # Each round measures both trees back to back, so a round's ratio
        # sees one state of the (shared, noisy) machine.
        ratios = sorted(b / p for b, p in zip(base, patched, strict=True))
        ratio = statistics.median(ratios)
        low, high = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        flag = "" if ratio >= TARGET else f"  below {TARGET}"
        out.append(
            f"{name:<{width}}  {statistics.median(base) * 1e3:8.1f}  "
            f"{statistics.median(patched) * 1e3:9.1f}  {ratio:11.3f}  "
            f"({low:.3f}-{high:.3f}){flag}"
        )
    return out + [
        "",
        f"CPU time, medians of {rounds} rounds; ratio = base/series, the median "
        f"of the rounds' ratios (target >= {TARGET})",
        "",
    ]


def scheduler_part(
    workers: dict[str, Worker], rows: list[str], args, rounds: int
) -> list[Cell]:
    # A small burst of every row first, not counted: each worker's code
    # paths warm before the first timed round.
    for row in rows:
        both(workers, f"scale prepare {row} 64 99")
        both(workers, f"scale run {args.window} 1 {args.limit} 1")
    cells = []
    for row in rows:
        for size in args.sizes:
            cell = Cell(row, size)
            drain = "1" if size <= args.drain_up_to else "0"
            # Small bursts take milliseconds: several drained ones a round.
            bursts = -(-ROUND_REQUESTS // size) if drain == "1" else 1
            start = time.monotonic()
            run = f"scale run {args.window} {drain} {args.limit} {bursts}"
            for r in range(rounds):
                both(workers, f"scale prepare {row} {size} {r}")
                for kind, answer in timed(workers, run, r, args.serial).items():
                    getattr(cell, kind).append(Round.from_worker(answer))
                # A round cut by the limit is a bound, and another one
                # would be cut too.
                if cell.cut():
                    break
            if size <= args.count_up_to:
                both(workers, f"scale prepare {row} {size} 0")
                counted = both(workers, "scale bytecodes")
                cell.bytecodes = {k: a["bytecodes"] for k, a in counted.items()}
            say(
                f"    {row} at {size:,}: {len(cell.base)} rounds, "
                f"{time.monotonic() - start:.0f}s"
                + (" (cut by --limit)" if cell.cut() else "")
            )
            cells.append(cell)
    return cells


def sizes(text: str) -> list[int]:
    try:
        values = sorted({int(x.replace("_", "")) for x in text.split(",") if x})
    except ValueError as e:
        raise ForkError(f"--sizes wants numbers separated by commas: {text!r}") from e
    if not values or values[0] < 1:
        raise ForkError(f"--sizes wants positive numbers: {text!r}")
    return values


def matching(names: list[str], only: list[str] | None) -> list[str]:
    return [n for n in names if not only or any(o in n for o in only)]


def bench_release(series: Series, args, out: list[str]) -> None:
    version = series.base().version
    work = args.work / f"v{version}"
    trees = {"base": work / "base", "series": work / "series"}
    checkout_base(series, trees["base"])
    apply_series(series, trees["series"])
    python = series_venv(
        version,
        trees["base"] / "requirements" / "common.txt",
        series.dir == DEFAULT_SERIES,
    )
    if "allocator" in args.parts or "scheduler" in args.parts:
        step(f"v{version}: starting a benchmark worker per tree")
        logs = WORK / "bench"
        workers = {
            kind: Worker(python, tree, logs / f"worker-v{version}-{kind}.log")
            for kind, tree in trees.items()
        }
        try:
            listing = both(workers, "list")["base"]
            names = matching(listing["allocator"], args.only)
            rows = matching(list(listing["scheduler"]), args.only)
            if "allocator" in args.parts and names:
                table = [f"### Allocator, v{version}", "", "```"]
                table += allocator_part(workers, names, args.rounds or 25, args.serial)
                table.insert(-1, "```")
                print("\n".join(table))
                out += table
            if "scheduler" in args.parts and rows:
                cells = scheduler_part(workers, rows, args, args.rounds or 3)
                what = {r: listing["scheduler"][r] for r in rows}
                table = scale_table(f"v{version}", cells, what, args.rounds or 3)
                print("\n".join(table))
                out += table
        finally:
            for w in workers.values():
                w.close()
    if "server" in args.parts:
        runs = serve_part(python, trees, version, args)
        if runs:
            table = serve_table(f"v{version}", runs)
            print("\n".join(table))
            out += table


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--series",
        type=Path,
        action="append",
        help="a series to time against its base (repeatable; default: patches/ "
        "and the newest release's)",
    )
    p.add_argument(
        "--part",
        dest="parts",
        action="append",
        choices=PARTS,
        help="only this part (repeatable; default: all three)",
    )
    p.add_argument(
        "--only",
        action="append",
        help="only benchmarks, rows and server configurations whose name "
        "contains this (repeatable)",
    )
    p.add_argument(
        "--sizes",
        type=sizes,
        default=list(SIZES),
        help="scheduler burst sizes, e.g. 64,512 (default: 64,512,4096,10000)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        help="rounds per measurement (default: 25 allocator, 3 scheduler, 5 server)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=40,
        help="scheduler steps timed per round after the burst (default 40)",
    )
    p.add_argument(
        "--drain-up-to",
        type=int,
        default=4096,
        help="time the whole drain up to this burst size (default 4096)",
    )
    p.add_argument(
        "--count-up-to",
        type=int,
        default=512,
        help="count the scheduler's bytecodes up to this burst size (default "
        "512; 0: never; tracing is about 30 times slower than running)",
    )
    p.add_argument(
        "--limit",
        type=float,
        default=15.0,
        help="CPU seconds a scheduler round may take before it is cut (default 15)",
    )
    p.add_argument(
        "--serial",
        action="store_true",
        help="time the allocator and scheduler on one tree at a time, the "
        "order alternating (default: both trees at once, one per core)",
    )
    p.add_argument(
        "--serve-requests",
        type=int,
        default=1200,
        help="requests per server run (default 1200)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="requests in flight against the server (default 32)",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=WORK,
        help="where the trees are built, v<version>/{base,series} (default: .work/)",
    )
    args = p.parse_args()
    if args.rounds is not None and args.rounds < 1:
        raise ForkError("--rounds must be at least 1")
    args.parts = args.parts or DEFAULT_PARTS
    all_series = (
        [Series(s.resolve()) for s in args.series]
        if args.series
        else default_and_newest(find_series())[0]
    )
    start = time.monotonic()
    out: list[str] = []
    for series in all_series:
        bench_release(series, args, out)
    report = WORK / "bench" / "bench.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(out) + "\n")
    say(f"done in {time.monotonic() - start:.0f}s; tables in {rel(report)}")
    return 0


if __name__ == "__main__":
    main_guard(main)
