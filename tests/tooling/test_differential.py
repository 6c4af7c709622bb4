"""The differential oracle's verdicts, on hand-made step records."""

from __future__ import annotations

import pytest

from prove import differential
from prove.differential import compare

STEP = {
    "sched": [["r0", 16]],
    "preempted": [],
    "finished": [],
    "free": 10,
    "running": 1,
    "waiting": 0,
    "remote_waiting": 0,
    "loads": 0,
    "stores": 0,
}
NO_CONNECTOR = {"offload": False, "lazy": False, "hybrid": False}
EAGER = {"offload": True, "lazy": False, "hybrid": False}
LAZY = {"offload": True, "lazy": True, "hybrid": False}


def rec(*steps, crash=None, violation=None):
    return {"steps": list(steps), "crash": crash, "violation": violation}


def step(**changes):
    return {**STEP, **changes}


def test_identical_records_are_the_same():
    r = rec(step(), step(free=8))
    assert compare(0, NO_CONNECTOR, r, r, differential.EFFECTS).kind == "same"


def test_without_a_connector_no_patch_explains_a_divergence():
    # An idle streaming session's blocks freed: what an earlier 0008 did.
    v = compare(0, NO_CONNECTOR, rec(step(), step()), rec(step(), step(free=13)), [])
    assert v.kind == "FAILED"
    assert "first divergence at step 1 in ['free']" in v.detail


def test_a_declared_effect_explains_a_divergence_where_it_applies():
    effects = differential.EFFECTS
    base, series = rec(step(), step(stores=0)), rec(step(), step(stores=3))
    v = compare(0, EAGER, base, series, effects)
    assert v.kind == "explained" and "store-only-blocks-that" in v.detail
    # Not by a patch the series does not carry.
    only_0001 = [e for e in effects if "Pin-SimpleCPUOffload" in e.patch]
    assert compare(0, EAGER, base, series, only_0001).kind == "FAILED"
    # Nor where its condition does not hold: the flush is eager only.
    flush = [e for e in effects if "Store-the-final-blocks" in e.patch]
    base, series = rec(step(free=10)), rec(step(free=8))
    assert compare(0, EAGER, base, series, flush).kind == "explained"
    assert compare(0, LAZY, base, series, flush).kind == "FAILED"


def test_the_comparison_stops_where_the_base_fails():
    # A crash ends the base's record before the step it crashed in.
    base = rec(step(), step(free=1), crash="AssertionError at popleft_n")
    series = rec(step(), step(free=1), step(free=4))
    v = compare(0, NO_CONNECTOR, base, series, [])
    assert v.kind == "base-failed"
    # A step the base got through differently is still a divergence.
    series = rec(step(), step(free=5), step())
    assert compare(0, NO_CONNECTOR, base, series, []).kind == "FAILED"
    # A base that breaks an invariant: its last step is where it broke.
    base = rec(step(), step(free=1), violation="step 1: block 3 freed twice")
    assert compare(0, NO_CONNECTOR, base, series, []).kind == "base-failed"


def test_a_series_that_crashes_or_breaks_an_invariant_fails():
    base = rec(step())
    for bad in ({"crash": "ValueError at x"}, {"violation": "step 0: leak"}):
        series = {**rec(step()), **bad}
        assert compare(0, NO_CONNECTOR, base, series, []).kind == "FAILED"


def test_a_series_that_crashes_as_the_base_does_is_the_base_failing():
    """The release's own crash, in the same function with the same message
    (lines moved by the patches), is no regression; another crash is."""
    crash = "RuntimeError at vllm/v1/core/sched/scheduler.py:{} schedule: Invalid"
    base = rec(step(), step(free=1), crash=crash.format(830))
    series = rec(step(), step(free=1), crash=crash.format(910))
    assert compare(0, NO_CONNECTOR, base, series, []).kind == "base-failed"
    series = rec(step(), step(free=1), crash="ValueError at x.py:3 f: other")
    assert compare(0, NO_CONNECTOR, base, series, []).kind == "FAILED"


def test_a_run_that_goes_on_longer_diverges_where_the_other_ended():
    v = compare(0, NO_CONNECTOR, rec(step()), rec(step(), step()), [])
    assert v.kind == "FAILED" and "['ended']" in v.detail


def test_a_series_that_steps_on_after_the_base_ended():
    # 0023 keeps the engine stepping until a store completes: the series'
    # record can run past the base's last one. Every effect's condition is
    # then asked about a step the base never took (the deadlock break's
    # read the base's record past its end and crashed the oracle).
    base = rec(step(stores=2))
    series = rec(step(stores=2), step(sched=[], running=0))
    keep = [e for e in differential.EFFECTS if "keep-the-engine" in e.patch]
    v = compare(0, LAZY, base, series, keep)
    assert v.kind == "explained" and "keep-the-engine" in v.detail
    deadlock = [e for e in differential.EFFECTS if "break-a-KV-deadlock" in e.patch]
    v = compare(0, LAZY, base, series, deadlock)
    assert v.kind == "FAILED" and "['ended']" in v.detail
    # Without a store in play, the extra step is not the keep-alive's.
    v = compare(0, LAZY, rec(step()), rec(step(), step(sched=[])), keep)
    assert v.kind == "FAILED"


def test_an_idle_lazy_step_that_stores_nothing_is_r11s_in_lazy_mode_only():
    # R11: a lazy step that schedules nothing while a store is in flight
    # starts no store, so the stores (and what follows them) differ.
    base = rec(step(stores=2), step(sched=[], running=0, stores=1))
    series = rec(step(stores=2), step(sched=[], running=0))
    r11 = [e for e in differential.EFFECTS if "an-idle-lazy-engine" in e.patch]
    v = compare(0, LAZY, base, series, r11)
    assert v.kind == "explained" and "an-idle-lazy-engine" in v.detail
    assert compare(0, EAGER, base, series, r11).kind == "FAILED"


def rec_done(*steps, completed=(), stalled=False, crash=None):
    return {
        **rec(*steps, crash=crash),
        "completed": list(completed),
        "stalled": stalled,
    }


def test_a_declared_effect_never_permits_less_progress():
    # The schedules differ where 0009 declares it may, but the series then
    # stalls with r1 unfinished, which the base completes: a failure.
    effects = [e for e in differential.EFFECTS if "go-on-to-the-requests" in e.patch]
    base = rec_done(step(loads=2), step(free=8), completed=["r0", "r1"])
    series = rec_done(step(loads=2), step(free=9), completed=["r0"], stalled=True)
    v = compare(0, EAGER, base, series, effects)
    assert v.kind == "FAILED" and v.series_stalled and not v.base_stalled
    assert "liveness: the series stalls with r1 unfinished" in v.detail
    # The same divergence with the series completing everything: explained.
    series = rec_done(step(loads=2), step(free=9), completed=["r0", "r1"])
    assert compare(0, EAGER, base, series, effects).kind == "explained"
    # Without a load in play (no connector, or none loaded yet), 0009
    # explains nothing: it takes no streaming session.
    assert compare(0, NO_CONNECTOR, base, series, effects).kind == "FAILED"
    base, series = rec_done(step(), step(free=8)), rec_done(step(), step(free=9))
    assert compare(0, EAGER, base, series, effects).kind == "FAILED"


def test_identical_stalls_are_the_same_and_counted():
    r = rec_done(step(), step(sched=[]), completed=["r0"], stalled=True)
    v = compare(0, NO_CONNECTOR, r, r, [])
    assert v.kind == "same" and v.base_stalled and v.series_stalled
    table = "\n".join(differential.liveness_table([v]))
    assert "| mixed | 1 | 1 | 1 |" in table
    v.newest_stalled = False
    assert "| mixed | 1 | 1 | 1 | 0 |" in "\n".join(differential.liveness_table([v]))
    assert differential.summary([v]).endswith("newest bare release 0")


def test_where_both_stall_the_series_completes_as_many_not_the_same():
    # async-mixed 115 on the 0.24.0 series: both trees stall with 7 requests
    # completed; the series' deadlock break took r2's blocks (the lowest
    # priority), so r11 completed where the base completed r2.
    base = rec_done(step(), completed=["r0", "r1", "r2"], stalled=True)
    other = rec_done(step(), completed=["r0", "r1", "r11"], stalled=True)
    assert differential.progress_lost(base, other) == ""
    fewer = rec_done(step(), completed=["r0", "r11"], stalled=True)
    assert "r1, r2 unfinished" in differential.progress_lost(base, fewer)
    # A series that ends unstalled without r2 (out of steps) still fails,
    # and so does one that stalls where the base drains.
    ended = rec_done(step(), completed=["r0", "r1", "r11"])
    assert "ends with r2 unfinished" in differential.progress_lost(base, ended)
    drained = rec_done(step(), completed=["r0", "r1", "r2"])
    assert "stalls with requests" in differential.progress_lost(drained, base)


def test_a_base_that_crashed_promises_no_progress():
    base = rec_done(step(), crash="ValueError at pool", completed=[])
    series = rec_done(step(), step(), completed=["r0"])
    assert differential.progress_lost(base, series) == ""
    assert differential.progress_lost(series, base) != ""


def test_session_hashes_explain_a_divergence_only_after_a_chunk():
    # 0013: a session's next chunk hits fewer stale prefix blocks, so it
    # schedules more tokens; before any chunk was sent it changes nothing.
    hashes = [e for e in differential.EFFECTS if "drop-the-hashes" in e.patch]
    base = rec(step(), step(sched=[["r5", 14]]))
    series = rec(step(), step(sched=[["r5", 30]]))
    after = {**NO_CONNECTOR, "first_chunk_step": 1}
    assert compare(0, after, base, series, hashes).kind == "explained"
    later = {**NO_CONNECTOR, "first_chunk_step": 2}
    assert compare(0, later, base, series, hashes).kind == "FAILED"
    assert compare(0, NO_CONNECTOR, base, series, hashes).kind == "FAILED"


class FakeWorker:
    """A trace worker that answers every trace with one identical record."""

    started: list[str] = []

    def __init__(self, python, tree, name, *args, **kwargs):
        self.name, self.stalled = name, name != "series"
        FakeWorker.started.append(name)

    def send(self, line: str) -> None:
        pass

    def receive(self, what: str, timeout: float) -> dict:
        return {**rec(step()), "stalled": self.stalled}

    def close(self) -> None:
        pass


def test_the_newest_release_as_its_own_base_runs_each_trace_once(monkeypatch, tmp_path):
    """On the newest release's series, the newest bare release is the base:
    its stalls are the base's, without a third worker."""
    monkeypatch.setattr(differential, "Worker", FakeWorker)
    base, series, other = tmp_path / "base", tmp_path / "series", tmp_path / "new"
    for newest, workers in [
        (base, ["series", "base"]),
        (other, ["series", "base", "newest"]),
    ]:
        FakeWorker.started = []
        verdicts, _ = differential.run_traces(
            tmp_path / "python",
            base,
            series,
            [],
            range(1),
            progress=False,
            out=tmp_path,
            families=("mixed",),
            newest=(tmp_path / "python", newest),
        )
        assert FakeWorker.started == workers
        assert [v.newest_stalled for v in verdicts] == [True]


def test_the_newest_bare_results_of_one_run_serve_the_next(monkeypatch, tmp_path):
    """make test: the newest release's differential keeps its base's results,
    and another series' run reads its liveness goal from them instead of
    running the newest bare release again; a trace not kept is run."""
    monkeypatch.setattr(differential, "Worker", FakeWorker)
    newest, other, kept = tmp_path / "newest", tmp_path / "other", tmp_path / "kept"

    def run(base, seeds, **caches):
        FakeWorker.started = []
        verdicts, _ = differential.run_traces(
            tmp_path / "python",
            base,
            tmp_path / "series",
            [],
            seeds,
            progress=False,
            out=tmp_path,
            families=("mixed",),
            newest=(tmp_path / "python", newest),
            **caches,
        )
        return verdicts

    run(newest, range(2), base_cache=kept)
    assert sorted(p.name for p in kept.iterdir()) == [
        "mixed-0-0.json",
        "mixed-0-1.json",
    ]
    verdicts = run(other, range(2), newest_cache=kept)
    assert FakeWorker.started == ["series", "base"]
    assert [v.newest_stalled for v in verdicts] == [True, True]
    (kept / "mixed-0-1.json").unlink()
    run(other, range(2), newest_cache=kept)
    assert FakeWorker.started == ["series", "base", "newest"]


def test_every_effect_names_a_patch_file_of_some_series():
    """An effect applies where its fragment is part of a patch's file name,
    which git format-patch cuts to 52 characters of the subject: a fragment
    past the cut would never apply (R11's first did not)."""
    from lib.paths import ROOT

    names = [p.name for p in (ROOT / "patches").rglob("*.patch")]
    dead = [
        e.patch for e in differential.EFFECTS if not any(e.patch in n for n in names)
    ]
    assert not dead, f"effects that match no patch file: {dead}"


def test_the_liveness_table_goes_between_its_markers_and_nowhere_else(tmp_path):
    page = tmp_path / "proving.md"
    before, after = "# Proving\n\nintro\n\n", "\n\nthe text after\n"
    old = f"{differential.LIVENESS_BEGIN}\n| old |\n{differential.LIVENESS_END}"
    page.write_text(before + old + after)
    table = ["| release | family |", "| --- | --- |", "| 0.24.0 | mixed |"]
    differential.write_liveness_docs(table, 200, ("mixed",), page)
    text = page.read_text()
    assert text.startswith(before) and text.endswith(after)
    assert "| old |" not in text and "| 0.24.0 | mixed |" in text
    assert "--all --seeds 200 --docs" in text
    page.write_text(before + after)
    with pytest.raises(differential.ForkError, match="no liveness markers"):
        differential.write_liveness_docs(table, 200, ("mixed",), page)
