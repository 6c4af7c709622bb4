"""What `make e2e` expects of a run, and the verdict on one.

A scenario says how to serve and what to send, and which reproducer stands
for the bug it shows. Where a release's series names that reproducer, the
bare release must break as declared: its engine dies of the bug's own
exception, raised where the bug raises it, or it loses CPU hits. Everywhere
else (the series always, the base where upstream fixed the bug) the run
must be clean: every request the client planned answered, the engine alive
with nothing left running or waiting and no exception logged, no content
violation, and the scenario's own condition met.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

REPRODUCERS = "tests/reproducers/"


@dataclass(frozen=True)
class Scenario:
    name: str
    serve: list[str]
    env: dict[str, str]
    client: list[str]
    # The reproducer that, named by a release's series, says the base breaks
    # here, and how ("dies", "loses CPU hits"); None: not judged on the base.
    reproducer: str | None = None
    breaks: str = ""
    # When the base dies: the exception its EngineCore must log, and the
    # function that must raise it (not, say, an assertion of the harness).
    base_exception: str = ""
    base_raiser: str = ""
    peer: bool = False


@dataclass
class Row:
    """One scenario run on one tree, as measured."""

    scenario: Scenario
    kind: str  # "base" or "series"
    planned: int = 0
    outcomes: list[str] = field(default_factory=list)
    alive: bool = False
    left: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    preemptions: float | None = None
    cpu_hits: tuple[int, int] | None = None  # (got, wanted) token counts
    gpu_hits: int = 0
    metrics_missing: bool = False
    peer_strikes: list[dict] = field(default_factory=list)
    exception: str = ""
    start_seconds: float = 0.0
    run_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def errors(self) -> Counter:
        return Counter(o for o in self.outcomes if o not in ("ok", "cancelled"))

    @property
    def effective_strikes(self) -> int:
        """Strikes where the peer really took blocks."""
        return sum(1 for s in self.peer_strikes if s.get("took", 0) > 0)


def clean_run_problems(row: Row) -> list[str]:
    problems = []
    if row.errors:
        problems.append(f"{sum(row.errors.values())} requests failed")
    if not row.alive:
        problems.append(f"engine dead ({row.exception or 'no exception logged'})")
    elif row.exception:
        problems.append(f"EngineCore logged {row.exception}")
    if row.alive and any(row.left.get(k) is None for k in ("running", "waiting")):
        problems.append("/metrics did not give the running and waiting counts")
    elif row.alive and any(row.left.get(k) for k in ("running", "waiting")):
        problems.append(
            f"left in the engine: {row.left.get('running')} running, "
            f"{row.left.get('waiting')} waiting"
        )
    if row.violations:
        problems.append(f"{len(row.violations)} content violations")
    if row.cpu_hits and row.cpu_hits[0] != row.cpu_hits[1]:
        problems.append(f"CPU hits {row.cpu_hits[0]} of {row.cpu_hits[1]} tokens")
    if row.scenario.peer and not row.effective_strikes:
        problems.append("the peer never took blocks")
    return problems


def judge(row: Row, named_reproducers: set[str]) -> None:
    """Fill row.problems; `named_reproducers`: the test ids (under
    tests/reproducers/) the tree's series names."""
    sc = row.scenario
    if row.planned == 0 or len(row.outcomes) != row.planned:
        row.problems.append(
            f"{len(row.outcomes)} outcomes for {row.planned} planned requests"
        )
        return
    if row.metrics_missing:
        row.problems.append("/metrics did not give the hit counts")
        return
    if row.cpu_hits and row.gpu_hits:
        row.problems.append(f"GPU prefix cache not reset ({row.gpu_hits} GPU hits)")
        return
    declared = sc.reproducer is not None and sc.reproducer in named_reproducers
    if row.kind == "series" or (sc.reproducer and not declared):
        row.problems += clean_run_problems(row)
    elif sc.breaks == "dies":
        if row.alive or not row.errors:
            row.problems.append(
                "the base should die here (a declared bug): "
                f"alive={row.alive}, {sum(row.errors.values())} errors"
            )
        elif not (
            row.exception.startswith(sc.base_exception)
            and row.exception.endswith(f"(in {sc.base_raiser})")
        ):
            row.problems.append(
                f"the base died of {row.exception or 'nothing logged'}, not of "
                f"the declared bug ({sc.base_exception} in {sc.base_raiser})"
            )
    elif sc.breaks == "loses CPU hits":
        if not row.alive or row.errors:
            row.problems.append("the base should stay up here")
        elif not row.cpu_hits or row.cpu_hits[0] >= row.cpu_hits[1]:
            row.problems.append(f"the base should lose CPU hits: {row.cpu_hits}")


def named_reproducers(series: Any) -> set[str]:
    return {
        t.removeprefix(REPRODUCERS) for p in series.patches() for t in p.reproducers()
    }


def verdict(r: Row) -> str:
    if r.problems:
        return "FAIL: " + "; ".join(r.problems)
    judged = r.kind == "series" or r.scenario.reproducer
    return "as expected" if judged else "not judged"
