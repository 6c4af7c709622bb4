"""Reproducer for issue 40's crash: a waiting request sits in the waiting
queues once, so the scan never takes one that is RUNNING already.

`make soak ARGS="--seed 4242 --runs 6 --scale 6"` found two traces where
the 0.20.2 series fails in schedule() with "Invalid request status:
RUNNING" and the bare release stalls. In both a request was in
skipped_waiting twice: the scan scheduled the first copy and then took the
second.

mixed 4559 (priority, streaming sessions, CPU offload): a session's next
chunk sets its arrival_time in place while it sits in the skipped_waiting
heap, so the heap's head is no longer its least request. When the scan
stops at that head for lack of blocks, _take_kv_holders (0009) removes the
holders and re-heapifies the queue, and the head changes; setting the
stopped request aside then popped the new head, another session, which
was lost from every queue, and left the stopped request both in
skipped_waiting and among the step's skipped requests. Breaking the stall
(0010) is what lets the trace get there.

async-mixed 5968 (FCFS, async scheduling): the ledger's
preempted-gets-stale-output. A session preempted with a step in
flight is stopped by that step's output; its next chunk dropped its
context, the chunk's turn scheduled one step too many, and that step's
output stopped it a second time, queueing it again. The bare release
stalls before it runs the session; 0010 breaks the stall, and 0017 keeps
the session's context.
"""

from __future__ import annotations

import pytest

from harness.trace_replay import assert_runs_to_the_end
from harness.trace_worker import run


@pytest.mark.parametrize(
    ("seed", "family"),
    [
        (4559, "mixed"),
        (5968, "async-mixed"),
    ],
)
def test_a_trace_from_soak_seed_4242_runs_to_the_end(seed, family):
    record = run(seed, family)
    # The bare release stalls on both: the series must not.
    assert_runs_to_the_end(record)
