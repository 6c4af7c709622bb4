"""make bench's scheduler-at-scale rows (harness.scale): they run, drain and
decide as the harness's own runner would. Nothing here looks at a time."""

from __future__ import annotations

import pytest

from harness.runner import FakeModelRunner
from harness.scale import ROWS, Bench, CpuLimit


@pytest.mark.parametrize("row", list(ROWS))
def test_every_row_drains_its_bursts(row):
    result = Bench(row, 16).run(window=40, drain=True, limit=120, bursts=2)
    assert result["finished"] == 32
    assert not result["over_limit"]
    assert result["steps"] > 0 and result["scheduled_tokens"] > 0
    # Every step of a burst this small is in its window.
    assert len(result["step_seconds"]) == 2 * result["steps"]
    # And each window step's tokens are counted, all of them.
    assert len(result["step_tokens"]) == len(result["step_seconds"])
    assert sum(result["step_tokens"]) == result["scheduled_tokens"]


@pytest.mark.parametrize("row", ["offload-tight", "offload-async"])
def test_the_light_runner_makes_the_decisions_of_the_fake_runner(row):
    """The benchmark's runner skips the content tags, nothing else: the
    scheduler steps, schedules and preempts as under the harness's runner."""
    light = Bench(row, 48).run(window=40, drain=True, limit=120)
    checked = Bench(row, 48)
    e = checked.e
    e.runner = FakeModelRunner(e.cfg, e.kv, e.requests, e.cuda.forward)
    full = checked.run(window=40, drain=True, limit=120)
    keys = ("steps", "finished", "preemptions", "scheduled_tokens", "loads")
    assert {k: light[k] for k in keys} == {k: full[k] for k in keys}
    assert light["preemptions"] > 0 and light["loads"] > 0


def test_the_bytecodes_of_a_burst_are_counted_alike_every_time():
    """The count make bench puts beside the timings: two engines built alike
    count alike (to the set orders that follow object addresses), and the
    trace is gone after the count."""
    import sys

    first, second = (Bench("tight", 16).count_bytecodes() for _ in range(2))
    assert first["steps"] == second["steps"] > 0
    assert first["bytecodes"] > 1000
    assert abs(first["bytecodes"] - second["bytecodes"]) < first["bytecodes"] / 100
    assert sys.gettrace() is None


def test_the_offload_rows_load_from_the_cpu():
    result = Bench("offload-burst", 32).run(window=40, drain=True, limit=120)
    assert result["loads"] > 0


def test_a_round_past_its_cpu_limit_is_cut_and_says_so(monkeypatch):
    # The watcher polls every CpuLimit.POLL_SECONDS: polled every 0.5 ms
    # against a limit already passed, it fires at its first poll, long
    # before a drain of 1,024 requests ends, however fast or loaded the
    # machine (a 0.2 s poll against 1 ms let the drain finish first on a
    # loaded one).
    monkeypatch.setattr(CpuLimit, "POLL_SECONDS", 0.0005)
    result = Bench("plain", 1024).run(window=1000, drain=True, limit=-1.0)
    assert result["over_limit"] and result["window_cut"]
    assert result["finished"] < 1024
