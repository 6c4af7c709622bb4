"""make e2e's judgement, on hand-made runs; its server start and workloads.

The real servers run in make test's "e2e vllm serve (short)" step and in
make e2e; these check what decides pass or fail, without a server.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lib.errors import ForkError
from lib.paths import ROOT
from lib.series import Series
from prove.e2e import scenarios
from prove.e2e_judge import REPRODUCERS, Row, judge, named_reproducers, verdict
from prove.e2e_load import load_jobs
from prove.e2e_server import ENGINE_EXCEPTION, Server, first_engine_exception

BY_NAME = {sc.name: sc for sc in scenarios(short=False)}
ALL_BUGS = {sc.reproducer for sc in BY_NAME.values() if sc.reproducer}
NO_BUGS: set[str] = set()
STRIKE = {"step": 5, "asked": 3, "took": 40}


def healthy(name: str, kind: str, **changes) -> Row:
    sc = BY_NAME[name]
    row = Row(sc, kind, planned=3, outcomes=["ok", "ok", "cancelled"], alive=True)
    row.left = {"running": 0.0, "waiting": 0.0}
    if name == "seed002":
        row.cpu_hits = (96, 96)
    if sc.peer:
        row.peer_strikes = [STRIKE]
    for k, v in changes.items():
        setattr(row, k, v)
    return row


def dead(name: str, exception: str) -> Row:
    return healthy(
        name,
        "base",
        planned=2,
        outcomes=["ok", "500 EngineCore"],
        alive=False,
        exception=exception,
    )


def problems(row: Row, named: set[str]) -> list[str]:
    judge(row, named)
    return row.problems


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_a_clean_series_run_passes(name):
    assert problems(healthy(name, "series"), ALL_BUGS) == []


@pytest.mark.parametrize(
    "changes, want",
    [
        ({"outcomes": ["ok", "ok", "500 EngineCore died"]}, "1 requests failed"),
        ({"alive": False, "exception": "AssertionError"}, "engine dead (Assertion"),
        ({"exception": "RuntimeError: x (in step)"}, "EngineCore logged RuntimeError"),
        ({"left": {"running": 1.0, "waiting": 0.0}}, "left in the engine: 1.0 run"),
        ({"left": {}}, "/metrics did not give the running and waiting"),
        ({"violations": ["step 3: r0 group 0 block #1 ..."]}, "1 content violations"),
        ({"outcomes": []}, "0 outcomes for 3 planned requests"),
        ({"planned": 0, "outcomes": []}, "0 outcomes for 0 planned requests"),
    ],
)
def test_the_series_must_answer_everything_and_stay_clean(changes, want):
    found = problems(healthy("load", "series", **changes), ALL_BUGS)
    assert any(p.startswith(want) for p in found), found


def test_the_series_must_bring_every_cpu_block_back():
    row = healthy("seed002", "series", cpu_hits=(48, 96))
    assert problems(row, ALL_BUGS) == ["CPU hits 48 of 96 tokens"]


def test_a_peer_that_took_nothing_proves_nothing():
    row = healthy("seed003", "series", peer_strikes=[{**STRIKE, "took": 0}])
    assert problems(row, ALL_BUGS) == ["the peer never took blocks"]


def test_hit_counts_must_be_measured():
    row = healthy("seed002", "base", cpu_hits=None, metrics_missing=True)
    assert problems(row, ALL_BUGS) == ["/metrics did not give the hit counts"]
    row = healthy("seed002", "series", gpu_hits=32)
    assert problems(row, ALL_BUGS) == ["GPU prefix cache not reset (32 GPU hits)"]


def test_a_declared_bug_must_kill_the_base_with_its_own_exception():
    assert problems(dead("seed000", "AssertionError (in popleft_n)"), ALL_BUGS) == []
    for wrong in (
        "TypeError: schedule() takes 1 argument (in schedule)",
        # An assertion of the fake CUDA is not the bug.
        "AssertionError: copy of a block never written (in batch_memcpy)",
    ):
        found = problems(dead("seed000", wrong), ALL_BUGS)
        assert found and "not of the declared bug" in found[0], wrong
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
    assert problems(dead("seed000", "AssertionError (in popleft_n)"), NO_BUGS)


def test_the_load_mix_is_not_judged_on_the_base():
    row = healthy("load", "base", alive=False, violations=["x"] * 5)
    assert problems(row, ALL_BUGS) == []
    assert verdict(row) == "not judged"


def test_the_real_series_name_the_scenarios_reproducers():
    """The scenarios' reproducers are real test ids, named by the default
    series: a renamed test would silently stop judging the base."""
    named = named_reproducers(Series(ROOT / "patches"))
    for sc in BY_NAME.values():
        if sc.reproducer:
            assert sc.reproducer in named, sc.name
            assert (ROOT / REPRODUCERS / sc.reproducer.split("::")[0]).is_file()


def test_the_engines_exception_and_its_raiser_are_read_from_the_log():
    core = "(EngineCore pid=7) ERROR 11-23 [core.py:1138]"
    log = "\n".join(
        [
            f"{core} Traceback (most recent call last):",
            f'{core}   File "/t/vllm/v1/core/sched/scheduler.py", line 9, in schedule',
            f'{core}   File "/t/vllm/v1/core/kv_cache_utils.py", line 3, in popleft_n',
            f"{core}     assert curr_block is not None",
            f"{core}            ^^^^^^^^^^^^^^^^^^^^^^",
            f"{core} AssertionError",
            "(APIServer pid=6) ERROR 11-23 [x.py:1] EngineDeadError: dead",
        ]
    )
    assert ENGINE_EXCEPTION.findall(log) == ["AssertionError"]
    assert first_engine_exception(log) == "AssertionError (in popleft_n)"
    line = f"{core} ValueError: Cannot get 10 free blocks from the pool"
    assert (
        first_engine_exception(line)
        == "ValueError: Cannot get 10 free blocks from the pool"
    )
    assert first_engine_exception("(APIServer pid=6) INFO all good") == ""


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


def test_a_servers_cpu_time_counts_every_process_of_its_session(tmp_path: Path):
    # A stand-in server: a parent that sleeps and a child that burns about
    # 0.3 s of CPU, both in the session Popen starts; cpu_seconds counts the
    # child's time too (EngineCore is the API server's child).
    import subprocess
    import sys

    burn = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', "
        "'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 0.3: pass\\ntime.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    server = Server(Path(sys.executable), tmp_path, "0.0.0", [], {}, tmp_path / "l")
    assert server.cpu_seconds() == 0.0  # not started
    server.proc = subprocess.Popen([sys.executable, "-c", burn], start_new_session=True)
    try:
        for _ in range(100):
            if server.cpu_seconds() >= 0.3:
                break
            time.sleep(0.1)
        assert server.cpu_seconds() >= 0.3
    finally:
        server.stop()


class _Base:
    def __init__(self, version: str) -> None:
        self.version = version


class _Series:
    def __init__(self, version: str) -> None:
        self.version = version

    def base(self) -> _Base:
        return _Base(self.version)

    def patches(self) -> list:
        return []


@pytest.mark.parametrize("short", [True, False])
def test_servers_at_a_time_keep_the_report_in_order(monkeypatch, tmp_path, short):
    """Two servers at a time (make test's short run): every run reported in
    the order of one at a time; the timed peer scenario makes it one."""
    from prove import e2e

    live, most = [0], [0]

    def fake_run(t, sc):
        live[0] += 1
        most[0] = max(most[0], live[0])
        time.sleep(0.05)
        live[0] -= 1
        return healthy(sc.name, t.kind)

    monkeypatch.setattr(e2e, "OUT", tmp_path)
    monkeypatch.setattr(e2e, "run_scenario", fake_run)
    targets = [
        e2e.Target(_Series(v), kind, tmp_path / f"{v}-{kind}", Path("python"))
        for v, kind in [("0.20.2", "base"), ("0.20.2", "series"), ("0.33.0", "series")]
    ]
    ok, report, summary = e2e.run_targets(targets, short=short, jobs=2)
    assert ok
    assert most[0] == (2 if short else 1)
    names = [(line.split()[0], line.split()[1].rstrip(":")) for line in summary]
    if short:
        # seed000 is judged as a pair: not on the newest series alone.
        want = [
            ("v0.20.2-base", "seed000"),
            ("v0.20.2-series", "seed000"),
            ("v0.20.2-series", "load"),
            ("v0.33.0-series", "load"),
        ]
    else:
        want = [(t.label, sc.name) for t in targets for sc in scenarios(short)]
    assert names == want
    assert [line for line in report if line.startswith("### ")] == [
        f"### {t.label} ({t.tree})" for t in targets
    ]


def test_a_run_that_fails_starts_no_other_server(monkeypatch, tmp_path):
    """A server that fails to start (or an interrupt) ends the runs: the
    ones not started yet never start, as when they ran one at a time."""
    from prove import e2e

    started: list[str] = []

    def fake_run(t, sc):
        started.append(f"{t.label} {sc.name}")
        raise ForkError("vllm serve not ready")

    monkeypatch.setattr(e2e, "OUT", tmp_path)
    monkeypatch.setattr(e2e, "run_scenario", fake_run)
    targets = [
        e2e.Target(_Series("0.20.2"), "series", tmp_path, Path("python")),
        e2e.Target(_Series("0.33.0"), "series", tmp_path, Path("python")),
    ]
    with pytest.raises(ForkError, match="not ready"):
        e2e.run_targets(targets, short=True, jobs=1)
    assert started == ["v0.20.2-series load"]


def test_one_server_at_a_time_runs_in_the_calling_thread(monkeypatch, tmp_path):
    """With one server at a time the runs are the caller's own: Ctrl-C
    reaches a server's start at once, not after it in a worker thread."""
    import threading

    from prove import e2e

    threads: set[str] = set()

    def fake_run(t, sc):
        threads.add(threading.current_thread().name)
        return healthy(sc.name, t.kind)

    monkeypatch.setattr(e2e, "OUT", tmp_path)
    monkeypatch.setattr(e2e, "run_scenario", fake_run)
    targets = [e2e.Target(_Series("0.20.2"), "series", tmp_path, Path("python"))]
    ok, _, _ = e2e.run_targets(targets, short=True, jobs=1)
    assert ok and threads == {threading.current_thread().name}
