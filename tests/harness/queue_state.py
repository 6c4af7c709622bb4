"""Order and membership of a scheduler's queues, checked at every step.

harness.invariants checks the block pool and harness.end_state what a
drained engine leaves; neither sees the queues. A request lost from every
queue waits forever without holding a block, and one queued twice is
scheduled twice: both showed up only as a stall or a crash far from the
step that broke the queue (the lost session of 0009's reproducer under
priority scheduling, the session 0017 left in two queues or none).

Engine.step checks these before it schedules (what add_request and abort
did) and after it processed the step's output, so every test and trace that
steps an Engine checks them. Each check returns a list of violations (empty
when consistent), as harness.invariants does.

The queues are found by what the scheduler has, not by release: `running`,
every attribute that is a RequestQueue (`waiting`, `skipped_waiting`, from
0.31.0 `kv_holding_waiting`), and sets of requests named *waiting that mark
some of those (`deferred_waiting` from 0.31.0).
"""

from __future__ import annotations

import re
from typing import Any

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request, RequestStatus


def waiting_queues(scheduler: Any) -> dict[str, RequestQueue]:
    """Every RequestQueue the scheduler keeps, by attribute name."""
    return {
        name: value
        for name, value in vars(scheduler).items()
        if isinstance(value, RequestQueue)
    }


def queue_items(queue: RequestQueue) -> list[Request]:
    """The queue's requests in its stored order, without the copy and sort
    a priority queue's iteration costs: a heap's list as it stands."""
    heap = heap_list(queue)
    return list(heap) if heap is not None else list(queue)


def heap_list(queue: RequestQueue) -> list[Request] | None:
    """The list a priority queue keeps its heap in (None for a FCFS deque)."""
    if isinstance(queue, list) or hasattr(queue, "popleft"):
        return None
    for value in vars(queue).values():
        if isinstance(value, list):
            return value
    return None


def marker_sets(scheduler: Any) -> dict[str, set[Request]]:
    """Sets of waiting requests kept beside the queues (0.31.0's
    deferred_waiting): each member must be in a waiting queue."""
    return {
        name: value
        for name, value in vars(scheduler).items()
        if "waiting" in name
        and isinstance(value, (set, frozenset))
        and all(isinstance(r, Request) for r in value)
    }


def membership_violations(scheduler: Any) -> list[str]:
    """Every unfinished request of the scheduler sits in exactly one of
    running and the waiting queues, once; a finished one (kept for a
    delayed free) in none; its queue agrees with its status; and the count
    of sessions waiting for input is right."""
    out = []
    queues: dict[str, list[Request]] = {"running": list(scheduler.running)}
    queues.update(
        (name, queue_items(q)) for name, q in waiting_queues(scheduler).items()
    )
    # Where each request is, by identity: a second Request object under a
    # known id is as wrong as the same object twice.
    where: dict[int, list[str]] = {}
    for name, items in queues.items():
        for req in items:
            where.setdefault(id(req), []).append(name)
            known = scheduler.requests.get(req.request_id)
            if known is not req:
                what = "an unknown request" if known is None else "a stale copy"
                out.append(f"{name} holds {req.request_id}, {what}")
            if req.is_finished():
                out.append(f"{name} holds {req.request_id}, {req.status.name}")
            elif name == "running" and req.status != RequestStatus.RUNNING:
                out.append(f"running holds {req.request_id} as {req.status.name}")
            elif name != "running" and req.status == RequestStatus.RUNNING:
                out.append(f"{name} holds {req.request_id} as RUNNING")
    for req_id, req in scheduler.requests.items():
        places = where.get(id(req), [])
        if req.is_finished() or len(places) == 1:
            continue
        if not places:
            out.append(f"{req_id} ({req.status.name}) is in no queue")
        else:
            out.append(f"{req_id} ({req.status.name}) is in {' and '.join(places)}")
    waiting = {
        id(r) for name, items in queues.items() if name != "running" for r in items
    }
    for name, members in marker_sets(scheduler).items():
        for req in members:
            if id(req) not in waiting:
                out.append(f"{name} names {req.request_id}, in no waiting queue")
    counted = getattr(scheduler, "num_waiting_for_streaming_input", None)
    if counted is not None:
        sessions = sum(
            r.status == RequestStatus.WAITING_FOR_STREAMING_REQ
            for r in scheduler.requests.values()
        )
        if counted != sessions:
            out.append(
                f"num_waiting_for_streaming_input is {counted} but {sessions} "
                "sessions wait for input"
            )
    return out


# The release's own _update_request_as_session (0.19.0 to 0.33.0, base and
# series alike) sets a waiting session's arrival_time to its next chunk's
# while the session sits in a priority heap: its key grows in place, so it
# sorts after a child it sits above. The series does not fix that (0009
# only stops relying on the heap's head there), so a trace records such a
# break apart from the violations that end it, and a test that meets it
# pins it (tests/harness_tests/test_queue_state.py).
KNOWN_SESSION_KEY = "known upstream, a session's key moved in the heap: "
# A request such a break leaves under the session stays out of order: the
# heap's later sifts move the session and leave the request under another
# parent (soak seed 2718's async-mixed 2904: r8 under the session r2, two
# steps on under r10). That is the same break, not a new one.
KNOWN_DOWNSTREAM = "known upstream, left out of order by a session's key: "
HEAP_CHILD = re.compile(r"heap order broken, (\S+) \(")


def is_known_upstream(problem: str) -> bool:
    """Whether a violation (as Engine.queue_violations words it) is the
    release's in-place session key change, or a request it left out of
    order, not a new break."""
    return KNOWN_SESSION_KEY in problem or KNOWN_DOWNSTREAM in problem


def mark_downstream(problems: list[str], misplaced: set[str]) -> list[str]:
    """`problems` with each heap break of a request an earlier known break
    left out of order marked KNOWN_DOWNSTREAM; the children of known breaks
    are added to `misplaced` (kept by the engine across its steps)."""
    out = []
    for problem in problems:
        found = HEAP_CHILD.search(problem)
        child = found.group(1) if found else None
        if child in misplaced and not is_known_upstream(problem):
            problem = KNOWN_DOWNSTREAM + problem
        if child is not None and is_known_upstream(problem):
            misplaced.add(child)
        out.append(problem)
    return out


def heap_violations(name: str, heap: list[Request]) -> list[str]:
    """A heap whose child sorts before its parent, by the requests' own
    comparison (priority, arrival_time, id), the one heapq uses: a key
    changed in place leaves such a pair, and pops then take the wrong
    request. A pair under a streaming session is the release's own key
    change (KNOWN_SESSION_KEY): a grown key sinks, so it is the parent."""
    out = []
    for i in range(1, len(heap)):
        parent = heap[(i - 1) // 2]
        if heap[i] < parent:
            known = KNOWN_SESSION_KEY if getattr(parent, "resumable", False) else ""
            out.append(
                f"{known}{name}: heap order broken, {heap[i].request_id} "
                f"(priority {heap[i].priority}, arrival {heap[i].arrival_time:.6f}) "
                f"under {parent.request_id} "
                f"(priority {parent.priority}, arrival {parent.arrival_time:.6f})"
            )
    return out


def keeps_arrival_order(req: Request) -> bool:
    """Whether FCFS must keep `req` in arrival order: a preempted request
    goes back to the front, and a streaming session's next chunk moves its
    arrival time while it stays where it waits."""
    return not req.num_preemptions and not getattr(req, "resumable", False)


def fcfs_violations(name: str, items: list[Request]) -> list[str]:
    """Requests that keep arrival order, out of it in a FCFS queue."""
    out = []
    last: Request | None = None
    for req in items:
        if not keeps_arrival_order(req):
            continue
        if last is not None and req.arrival_time < last.arrival_time:
            out.append(
                f"{name}: {req.request_id} (arrival {req.arrival_time:.6f}) "
                f"queued behind {last.request_id} (arrival {last.arrival_time:.6f})"
            )
        last = req
    return out


def order_violations(scheduler: Any) -> list[str]:
    """Each waiting queue in the order its policy promises."""
    out = []
    for name, queue in waiting_queues(scheduler).items():
        heap = heap_list(queue)
        if heap is not None:
            out += heap_violations(name, heap)
        else:
            out += fcfs_violations(name, list(queue))
    return out


def queue_violations(scheduler: Any) -> list[str]:
    """What is wrong with the scheduler's queues (empty when nothing)."""
    return membership_violations(scheduler) + order_violations(scheduler)


class QueueViolation(AssertionError):
    """Raised by Engine.step on a violation of the scheduler's bookkeeping
    (its queues here, each request's count of its steps in flight in
    harness.steps_in_flight), so that a test fails at the step that broke
    it (distinct from the harness's other assertions, which some tests
    expect)."""


def report(engine: Any, found: list[str], what: str) -> None:
    """Record each violation found on the engine, and raise unless the
    engine only records them (the trace and soak workers read
    engine.queue_violations)."""
    if not found:
        return
    engine.queue_violations += found
    if engine.raise_queue_violations:
        raise QueueViolation(f"{what}:\n  " + "\n  ".join(found))


def check_step(engine: Any, when: str) -> None:
    """Engine.step's check: each violation with the step it was found at."""
    if not engine.cfg.check_queues:
        return
    problems = mark_downstream(
        queue_violations(engine.scheduler), engine.known_misplaced
    )
    found = [f"{when} step {engine.stats.steps}: {p}" for p in problems]
    report(engine, found, "the scheduler's queues are inconsistent")


def assert_queues_ok(scheduler: Any, label: str = "queues") -> None:
    problems = queue_violations(scheduler)
    assert not problems, f"{label} are inconsistent:\n  " + "\n  ".join(problems)
