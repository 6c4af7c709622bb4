"""make e2e's judgement, on hand-made runs; its server start and workloads.

The real servers run in make test's "e2e vllm serve (short)" step and in
make e2e; these check what decides pass or fail, without a server.
"""

from __future__ import annotations

from pathlib import Path

import e2e
import pytest
from e2e import Row, judge, scenarios
from e2e_load import load_jobs
from e2e_server import ENGINE_EXCEPTION, Server

from common import ForkError
from series import Series

BY_NAME = {sc.name: sc for sc in scenarios(short=False)}


class FakePatch:
    def __init__(self, reproducers: list[str]):
        self._reproducers = reproducers

    def reproducers(self) -> list[str]:
        return self._reproducers


class FakeSeries:
    """A series naming these reproducers (as its patches' trailers do)."""

    def __init__(self, *names: str):
        self._patches = [FakePatch([e2e.REPRODUCERS + n for n in names])]

    def patches(self) -> list[FakePatch]:
        return self._patches


ALL_BUGS = FakeSeries(*(sc.reproducer for sc in BY_NAME.values() if sc.reproducer))
NO_BUGS = FakeSeries()


def healthy(name: str, kind: str, **changes) -> Row:
    sc = BY_NAME[name]
    row = Row(sc, kind, outcomes=["ok", "ok", "cancelled"], alive=True)
    if name == "seed002":
        row.cpu_hits = (96, 96)
    if sc.peer:
        row.peer_strikes = 3
    for k, v in changes.items():
        setattr(row, k, v)
    return row


def dead(name: str, exception: str) -> Row:
    return healthy(
        name,
        "base",
        outcomes=["ok", "500 EngineCore"],
        alive=False,
        exception=exception,
    )


def problems(row: Row, series) -> list[str]:
    judge(row, series)
    return row.problems


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_a_clean_series_run_passes(name):
    assert problems(healthy(name, "series"), ALL_BUGS) == []


@pytest.mark.parametrize(
    "changes, want",
    [
        (
            {"outcomes": ["ok", "500 EngineCore encountered an issue"]},
            "1 requests failed",
        ),
        (
            {"alive": False, "exception": "AssertionError"},
            "engine dead (AssertionError)",
        ),
        ({"violations": ["step 3: r0 group 0 block #1 ..."]}, "1 content violations"),
    ],
)
def test_the_series_must_answer_everything_and_stay_clean(changes, want):
    assert want in problems(healthy("load", "series", **changes), ALL_BUGS)


def test_the_series_must_bring_every_cpu_block_back():
    row = healthy("seed002", "series", cpu_hits=(48, 96))
    assert problems(row, ALL_BUGS) == ["CPU hits 48 of 96 tokens"]


def test_a_peer_that_never_struck_proves_nothing():
    row = healthy("seed003", "series", peer_strikes=0)
    assert problems(row, ALL_BUGS) == ["the peer never struck"]


def test_a_prefix_cache_not_reset_invalidates_the_cpu_hit_count():
    row = healthy("seed002", "series", gpu_hits=32)
    assert problems(row, ALL_BUGS) == ["GPU prefix cache not reset (32 GPU hits)"]


def test_a_declared_bug_must_kill_the_base_with_its_own_exception():
    assert problems(dead("seed000", "AssertionError"), ALL_BUGS) == []
    wrong = problems(
        dead("seed000", "TypeError: schedule() takes 1 argument"), ALL_BUGS
    )
    assert wrong and "not of the declared bug (AssertionError)" in wrong[0]
    survived = problems(healthy("seed003", "base"), ALL_BUGS)
    assert survived and "the base should die here" in survived[0]


def test_a_declared_lost_hit_must_show_on_the_base():
    assert problems(healthy("seed002", "base", cpu_hits=(48, 96)), ALL_BUGS) == []
    complete = problems(healthy("seed002", "base"), ALL_BUGS)
    assert complete and "the base should lose CPU hits" in complete[0]


def test_where_upstream_fixed_the_bug_the_base_must_be_clean():
    # A release whose series does not name the reproducer: the base has the
    # fix, and dying there is a failure, not the expected bug.
    assert problems(healthy("seed000", "base"), NO_BUGS) == []
    assert problems(dead("seed000", "AssertionError"), NO_BUGS)


def test_the_load_mix_is_not_judged_on_the_base():
    row = healthy("load", "base", alive=False, violations=["x"] * 5)
    assert problems(row, ALL_BUGS) == []
    assert e2e.verdict(row) == "not judged"


def test_the_real_series_name_the_scenarios_reproducers():
    """The scenarios' reproducers are real test ids, named by the default
    series: a renamed test would silently stop judging the base."""
    named = {t for p in Series(e2e.ROOT / "patches").patches() for t in p.reproducers()}
    for sc in BY_NAME.values():
        if sc.reproducer:
            assert e2e.REPRODUCERS + sc.reproducer in named, sc.name


def test_the_engines_exception_is_read_from_the_log():
    log = "\n".join(
        [
            "(EngineCore pid=7) ERROR 11-23 [core.py:1136]     raise ValueError(",
            "(EngineCore pid=7) ERROR 11-23 05:41:16 [core.py:1138] Traceback (most",
            "(EngineCore pid=7) ERROR 11-23 05:41:16 [core.py:1138] AssertionError",
            "(APIServer pid=6) ERROR 11-23 05:41:16 [x.py:1] EngineDeadError: dead",
        ]
    )
    assert ENGINE_EXCEPTION.findall(log) == ["AssertionError"]
    line = "(EngineCore pid=7) ERROR 1 [c.py:2] ValueError: Cannot get 10 free blocks"
    assert ENGINE_EXCEPTION.findall(line) == ["ValueError: Cannot get 10 free blocks"]


def test_load_jobs_are_deterministic_and_fit_the_model():
    jobs = load_jobs(200, max_model_len=512)
    assert jobs == load_jobs(200, max_model_len=512)
    assert all(len(j.prompt) + j.max_tokens <= 512 for j in jobs)
    assert all(3 <= t < 1024 for j in jobs for t in j.prompt)
    assert any(j.stream and j.cancel_after for j in jobs)
    assert any(not j.stream for j in jobs)


def test_a_server_that_exits_at_start_is_a_clear_error(tmp_path: Path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'vllm: no such model' >&2\nexit 3\n")
    python.chmod(0o755)
    log = tmp_path / "serve.log"
    server = Server(python, tmp_path, "0.0.0", [], {}, log)
    with pytest.raises(ForkError, match=r"exited \(3\) before it was ready"), server:
        pass
    assert "no such model" in log.read_text()
