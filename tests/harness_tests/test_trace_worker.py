"""The differential oracle's traces and their runner, on the tree under test."""

from __future__ import annotations

from harness.trace_worker import run
from harness.traces import generate


def test_a_seed_gives_the_same_trace():
    assert generate(7) == generate(7)
    assert generate(7) != generate(8)


def test_traces_cover_what_the_scheduler_supports():
    traces = [generate(seed) for seed in range(200)]
    kinds = {t.connector for t in traces}
    assert kinds == {"none", "eager", "lazy"}
    cfgs = [t.cfg for t in traces]
    for key in ("hybrid", "prefix_caching", "enable_chunked_prefill"):
        assert {c[key] for c in cfgs} == {True, False}, key
    assert {c["policy"] for c in cfgs} == {"fcfs", "priority"}
    events = {e[0] for t in traces for evs in t.events.values() for e in evs}
    assert events == {"add", "chunk", "end", "abort"}


def test_a_trace_runs_and_records_every_step():
    out = run(3)
    assert out["crash"] is None and out["violation"] is None
    assert out["steps"], "nothing was recorded"
    first = out["steps"][0]
    assert set(first) == {
        "sched",
        "preempted",
        "finished",
        "free",
        "running",
        "waiting",
        "remote_waiting",
        "loads",
        "stores",
    }
    # The same seed replays step for step.
    assert run(3) == out
