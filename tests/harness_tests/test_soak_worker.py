"""The soak worker: one seed replays the same run, with or without the
checks, and --serve answers one JSON line per request line."""

from __future__ import annotations

import io
import json

from harness import soak_worker


def test_a_timing_run_is_the_same_run_without_checks():
    checked = soak_worker.run("mixed-full-lazy", 3, 1)
    again = soak_worker.run("mixed-full-lazy", 3, 1)
    timing = soak_worker.run("mixed-full-lazy", 3, 1, checks=False)
    assert checked["crash"] is None
    keys = (
        "steps",
        "scheduled_tokens",
        "completed",
        "aborted",
        "preemptions",
        "unfinished",
    )
    assert [checked[k] for k in keys] == [again[k] for k in keys]
    assert [checked[k] for k in keys] == [timing[k] for k in keys]
    assert checked["scheduler_seconds"] > 0
    assert checked["scheduled_tokens"] > 0


def test_serve_answers_each_line(monkeypatch, capsys):
    monkeypatch.setattr(
        "sys.stdin", io.StringIO("seed002-flush 0 1\n\nseed002-flush 1 1 timing\n")
    )
    soak_worker.serve()
    lines = capsys.readouterr().out.splitlines()
    results = [json.loads(line) for line in lines]
    assert [(r["workload"], r["seed"]) for r in results] == [
        ("seed002-flush", 0),
        ("seed002-flush", 1),
    ]
    # The checked run looks at the CPU's content; the timing run does not.
    assert "lost_cpu_blocks" in results[0]
    assert "lost_cpu_blocks" not in results[1]
