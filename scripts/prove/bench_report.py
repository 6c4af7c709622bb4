"""What `make bench` prints about the scheduler at scale and the real server.

Pure logic, no vLLM: the rounds the workers measured go in, tables come
out. Each round measured both trees back to back, so a ratio is taken
round by round (one state of the shared, noisy machine) and the median of
the rounds' ratios is shown, as the allocator rows do. Timings only:
nothing fails on them, a ratio past its target is flagged.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

# series/base above this is flagged (issue 38's target for a scheduler step
# and for the total CPU to drain a burst).
SCALE_TARGET = 1.05
# series/base requests per second below this is flagged (the real server).
SERVE_TARGET = 0.98
# Sizes the exponent is fitted over (requests in the burst).
FIT_FROM, FIT_TO = 512, 10_000


@dataclass
class Round:
    """One tree's figures in one round of a scheduler-at-scale cell."""

    step_seconds: float  # mean scheduler CPU per step over the timed window
    drain_seconds: float | None  # scheduler CPU to drain the burst (None: not asked)
    window_cut: bool = False  # the CPU limit cut the window: a lower bound
    drain_cut: bool = False  # the CPU limit cut the drain: a lower bound
    steps: int = 0  # steps taken (to drain, when drained)
    # Scheduler CPU per token the window's steps scheduled (None: no token
    # counted). Where the trees decide differently, a tree that drains in
    # fewer steps schedules more in each: this compares the same work.
    token_seconds: float | None = None

    @classmethod
    def from_worker(cls, answer: dict) -> Round:
        per_step = answer["step_seconds"]
        # A cut window still had all its steps ahead of it: its mean over
        # the whole window is at least what it used divided by the window.
        steps = answer["window"] if answer["window_cut"] else len(per_step)
        # A cut window's steps never run hold no tokens and no CPU, and the
        # cut step its CPU but not its tokens: no figure per token.
        tokens = 0 if answer["window_cut"] else sum(answer.get("step_tokens", ()))
        return cls(
            step_seconds=sum(per_step) / max(1, steps),
            drain_seconds=answer["drain_seconds"],
            window_cut=answer["window_cut"],
            drain_cut=answer["over_limit"],
            steps=answer["steps"],
            token_seconds=sum(per_step) / tokens if tokens else None,
        )


@dataclass
class Cell:
    """One row at one size: every round of both trees."""

    row: str
    size: int
    base: list[Round] = field(default_factory=list)
    series: list[Round] = field(default_factory=list)
    # The scheduler's Python bytecodes to drain one burst, per tree, where
    # counted (bench.py --count-up-to).
    bytecodes: dict[str, int] | None = None

    def cut(self) -> bool:
        return any(r.window_cut for r in self.base + self.series)

    def step_ms(self, kind: str) -> Bound:
        rounds = getattr(self, kind)
        return Bound(
            1e3 * statistics.median(r.step_seconds for r in rounds),
            any(r.window_cut for r in rounds),
        )

    def step_ratio(self) -> Ratio:
        return ratio_of(
            [(b.step_seconds, b.window_cut) for b in self.base],
            [(s.step_seconds, s.window_cut) for s in self.series],
        )

    def token_ratio(self) -> Ratio | None:
        """Series/base of the CPU per scheduled token in the window."""
        rounds = self.base + self.series
        if not rounds or any(r.token_seconds is None for r in rounds):
            return None
        return ratio_of(
            [(b.token_seconds or 0.0, b.window_cut) for b in self.base],
            [(s.token_seconds or 0.0, s.window_cut) for s in self.series],
        )

    def schedules_differ(self) -> bool:
        """Whether the trees drained the first round in different numbers
        of steps: they decided differently, and a step is not the same work."""
        b, s = self.base[0], self.series[0]
        drained = b.drain_seconds is not None and not (b.drain_cut or s.drain_cut)
        return drained and b.steps != s.steps

    def drain_ratio(self) -> Ratio | None:
        if any(r.drain_seconds is None for r in self.base + self.series):
            return None
        return ratio_of(
            [(b.drain_seconds or 0.0, b.drain_cut) for b in self.base],
            [(s.drain_seconds or 0.0, s.drain_cut) for s in self.series],
        )

    def bytecode_ratio(self) -> str:
        """Series/base of the bytecodes counted, '-' where not counted."""
        if not self.bytecodes or not self.bytecodes.get("base"):
            return "-"
        value = self.bytecodes["series"] / self.bytecodes["base"]
        return f"{value:.3f}" + (" **!**" if value > SCALE_TARGET else "")

    def drain_steps(self) -> str:
        """Steps each tree took to drain the first round (where both did):
        a series that decides differently shows here."""
        b, s = self.base[0], self.series[0]
        if b.drain_seconds is None or b.drain_cut or s.drain_cut:
            return "-"
        return f"{b.steps}/{s.steps}"


@dataclass(frozen=True)
class Bound:
    """A figure, or a lower bound on it where the CPU limit cut a round."""

    value: float
    lower: bool = False

    def show(self, digits: int = 2) -> str:
        return (">" if self.lower else "") + f"{self.value:.{digits}f}"


@dataclass(frozen=True)
class Ratio:
    """series/base, the median of the rounds' ratios; `bound` says which
    way it is only a bound: ">" (the series was cut: at least this), "<"
    (the base was cut: at most this), "?" (both were: unknown)."""

    value: float
    bound: str = ""

    def show(self) -> str:
        return "?" if self.bound == "?" else f"{self.bound}{self.value:.2f}"

    def flagged(self, target: float = SCALE_TARGET) -> bool:
        return self.bound in ("", ">") and self.value > target


def ratio_of(base: list[tuple[float, bool]], series: list[tuple[float, bool]]) -> Ratio:
    """Median of series/base over rounds of (seconds, cut by the limit)."""
    ratios = [s / b for (b, _), (s, _) in zip(base, series, strict=True) if b > 0]
    value = statistics.median(ratios) if ratios else math.nan
    base_cut = any(cut for _, cut in base)
    series_cut = any(cut for _, cut in series)
    bound = {(False, False): "", (False, True): ">", (True, False): "<"}
    return Ratio(value, bound.get((base_cut, series_cut), "?"))


def fit_exponent(
    points: list[tuple[float, float]], low: float = FIT_FROM, high: float = FIT_TO
) -> float | None:
    """The slope of log(time) against log(requests), least squares, over the
    points with `low` <= requests <= `high`: 1 is linear, 2 quadratic.
    None with fewer than two such points (or a time that is not positive)."""
    kept = [(x, y) for x, y in points if low <= x <= high]
    if len({x for x, _ in kept}) < 2 or any(y <= 0 for _, y in kept):
        return None
    xs = [math.log(x) for x, _ in kept]
    ys = [math.log(y) for _, y in kept]
    return statistics.linear_regression(xs, ys).slope


def exponent(cells: list[Cell], kind: str) -> str:
    """The fitted exponent of one tree's time per step over one row's cells;
    ">" when a point is only a lower bound (a larger size was cut)."""
    points = [(c.size, c.step_ms(kind).value) for c in cells]
    slope = fit_exponent(points)
    if slope is None:
        return "-"
    cut = any(c.step_ms(kind).lower for c in cells if FIT_FROM <= c.size <= FIT_TO)
    return (">" if cut else "") + f"{slope:.2f}"


def scale_table(
    release: str, cells: list[Cell], rows: dict[str, str], rounds: int
) -> list[str]:
    """The markdown table of one release's scheduler-at-scale cells, and
    the fitted exponents per row."""
    out = [
        f"### Scheduler at scale, {release}: series/base",
        "",
        "| row | requests | base ms/step | series ms/step | series/base "
        "| per scheduled token series/base | total CPU series/base "
        "| bytecodes series/base | drain steps base/series |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    flagged, differ = [], []
    for c in cells:
        step, token, drain = c.step_ratio(), c.token_ratio(), c.drain_ratio()
        flags = [w for w, r in (("step", step), ("total", drain)) if r and r.flagged()]
        if "step" in flags and c.schedules_differ():
            # Still flagged: the series' step may do more work, and the
            # figures that compare the same work are named with it.
            flags[0] = f"step; schedules differ, per token {shown(token)}"
            differ.append(f"{c.row} at {c.size:,}")
        if token and token.flagged():
            flags.append("per token")
        if c.bytecode_ratio().endswith("**!**"):
            flags.append("bytecodes")
        if flags:
            flagged.append(f"{c.row} at {c.size:,} ({', '.join(flags)})")
        out.append(
            f"| {c.row} | {c.size:,} | {c.step_ms('base').show()} | "
            f"{c.step_ms('series').show()} | {shown(step)} | {shown(token)} | "
            f"{shown(drain)} | {c.bytecode_ratio()} | {c.drain_steps()} |"
        )
    out += [
        "",
        f"Exponent of ms/step against requests, {FIT_FROM:,}-{FIT_TO:,} "
        "(log-log least squares; 1 is linear):",
        "",
        "| row | what | base | series |",
        "| --- | --- | ---: | ---: |",
    ]
    for row, what in rows.items():
        mine = [c for c in cells if c.row == row]
        if mine:
            out.append(
                f"| {row} | {what} | {exponent(mine, 'base')} | "
                f"{exponent(mine, 'series')} |"
            )
    out.append("")
    out.append(
        f"ms/step: the scheduler's CPU per step over the timed window, median of "
        f"up to {rounds} rounds; ratios: median of the rounds' series/base. "
        f"'>': a lower bound (the round reached its CPU limit); '-': not "
        f"measured (total CPU is measured where the burst is drained). Where "
        f"the trees drain in different numbers of steps, the total compares "
        f"the work; a step of a tree that takes fewer does more, and the CPU "
        f"per token the window's steps scheduled compares the same work. "
        f"Bytecodes: "
        f"the Python bytecodes the scheduler executed to drain one burst, "
        f"series/base, counted (not timed): the same on any machine to about "
        f"0.1 %."
    )
    if flagged:
        out.append(f"**!** above {SCALE_TARGET}: " + "; ".join(flagged) + ".")
    if differ:
        out.append(
            "Per step past the target where the trees decide differently (a step "
            "of the tree that drains in fewer does more; compare per token and "
            "in total): " + "; ".join(differ) + "."
        )
    return out + [""]


def shown(ratio: Ratio | None) -> str:
    """A table cell: the ratio, marked when past its target."""
    if ratio is None:
        return "-"
    return ratio.show() + (" **!**" if ratio.flagged() else "")


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (1-99) of `values`, interpolated between ranks."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass
class ServeRun:
    """One load run against one server."""

    requests: int
    seconds: float
    latencies: list[float]  # of the requests that were answered
    errors: int = 0
    # CPU time the server's processes spent on the run: what the scheduler's
    # cost shows in, where the run's wall time also carries the client's and
    # the rest of the machine's share of the cores.
    cpu_seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_per_request(self) -> float:
        """nan where not measured (no CPU read, no request answered)."""
        if self.cpu_seconds <= 0 or not self.requests:
            return math.nan
        return self.cpu_seconds / self.requests


def paired_median(base: list[float], series: list[float]) -> float:
    """The median of the round-by-round series/base ratios, over the rounds
    that measured both (nan if none did)."""
    ratios = [s / b for b, s in zip(base, series, strict=True) if b > 0 and s > 0]
    return statistics.median(ratios) if ratios else math.nan


def median_shown(values: list[float], scale: float = 1.0) -> str:
    """The median of the measured values (not nan), '-' if none."""
    kept = [v for v in values if not math.isnan(v)]
    return f"{scale * statistics.median(kept):.1f}" if kept else "-"


def serve_table(release: str, runs: dict[str, dict[str, list[ServeRun]]]) -> list[str]:
    """The markdown table of one release's real-server rows: per
    configuration, each tree's requests/s (median of its runs), latency
    percentiles (over all its answered requests) and the server's CPU time
    per answered request (median of its runs). Both ratios read as capacity,
    series over base: the rates', and the base's CPU per request over the
    series'."""
    out = [
        f"### The real server, {release}: series/base",
        "",
        "| configuration | base req/s | series req/s | series/base "
        "| base p50/p99 ms | series p50/p99 ms | server CPU ms/req base/series "
        "| CPU base/series | errors base/series |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    flagged = []
    for name, kinds in runs.items():
        base, series = kinds["base"], kinds["series"]
        ratio = paired_median([r.rate for r in base], [r.rate for r in series])
        cpu_ratio = paired_median(
            [r.cpu_per_request for r in series], [r.cpu_per_request for r in base]
        )
        marks = [" **!**" if v < SERVE_TARGET else "" for v in (ratio, cpu_ratio)]
        which = [w for w, m in zip(("req/s", "CPU"), marks, strict=True) if m]
        if which:
            flagged.append(f"{name} ({', '.join(which)})")
        cells = []
        for runs_of in (base, series):
            lat = [x for r in runs_of for x in r.latencies]
            cells.append(
                f"{1e3 * percentile(lat, 50):.0f}/{1e3 * percentile(lat, 99):.0f}"
                if lat
                else "-"
            )
        cpu = [
            median_shown([r.cpu_per_request for r in runs_of], 1e3)
            for runs_of in (base, series)
        ]
        out.append(
            f"| {name} | {statistics.median(r.rate for r in base):.1f} | "
            f"{statistics.median(r.rate for r in series):.1f} | "
            f"{ratio:.2f}{marks[0]} | "
            f"{cells[0]} | {cells[1]} | {cpu[0]}/{cpu[1]} | "
            f"{shown_value(cpu_ratio)}{marks[1]} | {sum(r.errors for r in base)}/"
            f"{sum(r.errors for r in series)} |"
        )
    out.append("")
    if flagged:
        out.append(f"**!** below {SERVE_TARGET}: " + ", ".join(flagged) + ".")
    return out + [""]


def shown_value(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"
