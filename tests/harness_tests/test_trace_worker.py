"""The differential oracle's traces and their runner, on the tree under test."""

from __future__ import annotations

from harness.trace_worker import run
from harness.traces import generate, generate_offload


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


def test_offload_scenarios_load_after_a_prefix_cache_reset():
    traces = [generate_offload(seed) for seed in range(100)]
    assert all(t.cfg["offload"] and t.family == "offload" for t in traces)
    assert {t.cfg["policy"] for t in traces} == {"fcfs", "priority"}
    assert {t.cfg["hybrid"] for t in traces} == {True, False}
    assert all(t.events[1] == [("reset",)] for t in traces)
    # Prefixes first, then the arrivals that reuse them from the CPU.
    out = run(5, "offload")
    assert out["crash"] is None and out["violation"] is None
    assert any(s["loads"] or s["remote_waiting"] for s in out["steps"])


def test_a_run_records_what_completed_and_whether_it_stalled():
    out = run(3)
    assert out["completed"] and out["stalled"] in (True, False)
    assert set(out["completed"]) <= {
        e[1] for evs in generate(3).events.values() for e in evs if e[0] == "add"
    }
