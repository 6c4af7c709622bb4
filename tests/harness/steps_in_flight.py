"""Each request's count of its steps in flight, checked at every schedule().

Under async scheduling or pipeline stages a request's output arrives steps
after it was scheduled. The series (0016, 0.19.0-0.26.0) counts those steps
per request (`Request.num_steps_in_flight`) so that a preemption can mark
the output still to come as stale (`num_stale_steps`). The count is kept
only where steps overlap (`Scheduler.count_steps_in_flight`): a synchronous
engine processes each step's output before the next schedule(), and its
requests keep 0, so that the count costs nothing there.

Engine._launch checks, right after each schedule(), that every request's
count is the number of steps the engine holds in flight with the request
in them, the one just scheduled included (0 where steps do not overlap),
and that no more of them are stale than are in flight. So every test and
trace checks the count, not only the tests of the preemption it serves.
Trees whose requests have no such count (the bare releases, the series
from 0.27.0, where upstream counts tokens instead) are not checked.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput

from harness import queue_state


def steps_overlap(cfg: Any) -> bool:
    """Whether the engine schedules again before a step's output is in."""
    return bool(cfg.async_scheduling) or cfg.pipeline_parallel_size > 1


def count_violations(engine: Any, scheduled: SchedulerOutput) -> list[str]:
    """Requests whose count of steps in flight is wrong, just after
    `scheduled` was scheduled (before it joins engine.in_flight)."""
    scheduler = engine.scheduler
    steps = [so.num_scheduled_tokens for so, _, _ in engine.in_flight]
    steps.append(scheduled.num_scheduled_tokens)
    overlap = steps_overlap(engine.cfg)
    out = []
    for req_id, request in scheduler.requests.items():
        if not hasattr(request, "num_steps_in_flight"):
            return []  # a tree without the count
        want = sum(req_id in step for step in steps) if overlap else 0
        got = request.num_steps_in_flight
        if got != want:
            out.append(f"{req_id} counts {got} steps in flight, the engine has {want}")
        if request.num_stale_steps > got:
            out.append(
                f"{req_id} has {request.num_stale_steps} stale steps of {got} in flight"
            )
    return out


def check(engine: Any, scheduled: SchedulerOutput) -> None:
    """Engine._launch's check, on and off with harness.queue_state's (off
    for make bench and the soak's timing runs), and reported as it is:
    raised, or recorded for the trace and soak workers."""
    if not engine.cfg.check_queues:
        return
    found = [
        f"schedule of step {engine.stats.steps}: {p}"
        for p in count_violations(engine, scheduled)
    ]
    queue_state.report(engine, found, "the count of steps in flight is wrong")
