"""make bench's arithmetic (scripts/prove/bench_report.py, bench.py): the
exponent fit, the ratios and their bounds, the tables and their flags. No
timing is measured here; the harness side is tested in
tests/harness_tests/test_scale.py."""

from __future__ import annotations

import argparse
import http.server
import json
import math
import sys
import threading
from pathlib import Path

import pytest

from lib.errors import ForkError
from prove.bench import alternate, sizes, timed
from prove.bench_report import (
    Cell,
    Ratio,
    Round,
    ServeRun,
    exponent,
    fit_exponent,
    percentile,
    ratio_of,
    scale_table,
    serve_table,
)


def answer(per_step: list[float], drain=None, window=40, cut=False, over=None):
    return {
        "step_seconds": per_step,
        "window": window,
        "drain_seconds": drain,
        "window_cut": cut,
        "over_limit": cut if over is None else over,
        "steps": len(per_step),
    }


def cell(row: str, size: int, base: float, series: float, rounds: int = 3) -> Cell:
    c = Cell(row, size)
    c.base = [Round(base, base * 10, steps=10) for _ in range(rounds)]
    c.series = [Round(series, series * 10, steps=10) for _ in range(rounds)]
    return c


@pytest.mark.parametrize("k", [0.0, 1.0, 2.0, 0.5])
def test_the_exponent_of_a_power_law_is_its_power(k):
    points = [(n, 3e-3 * n**k) for n in (512, 4096, 10_000)]
    assert fit_exponent(points) == pytest.approx(k, abs=1e-9)


def test_the_fit_keeps_only_the_sizes_from_512_to_10000():
    # 64 is off the line and left out; so would be 20,000.
    points = [(64, 1.0), (512, 512.0), (4096, 4096.0), (20_000, 1.0)]
    assert fit_exponent(points) == pytest.approx(1.0)


def test_no_exponent_from_one_size_or_a_time_of_zero():
    assert fit_exponent([(512, 1.0), (64, 2.0)]) is None
    assert fit_exponent([(512, 1.0), (4096, 0.0)]) is None


def test_a_cut_round_gives_a_lower_bound_over_the_whole_window():
    # Cut in the third of 40 steps: at least 3 s over 40 steps.
    r = Round.from_worker(answer([1.0, 1.0, 1.0], window=40, cut=True))
    assert r.step_seconds == pytest.approx(3.0 / 40)
    assert r.window_cut and r.drain_cut
    # A burst drained in fewer steps than the window: its own mean.
    r = Round.from_worker(answer([1.0, 3.0], drain=4.0, window=40))
    assert r.step_seconds == 2.0 and not r.window_cut


def test_the_ratio_is_the_median_of_the_rounds_series_over_base():
    r = ratio_of([(1.0, False), (2.0, False), (1.0, False)], [(1.1, False)] * 3)
    assert r == Ratio(pytest.approx(1.1), "")
    assert ratio_of([(1.0, False)], [(2.0, True)]).bound == ">"
    assert ratio_of([(1.0, True)], [(2.0, False)]).bound == "<"
    assert ratio_of([(1.0, True)], [(2.0, True)]).show() == "?"


def test_only_a_ratio_that_is_at_least_past_the_target_is_flagged():
    assert Ratio(1.06).flagged() and Ratio(1.06, ">").flagged()
    assert not Ratio(1.05).flagged()
    # At most 1.2: it may be under the target.
    assert not Ratio(1.2, "<").flagged()
    assert not Ratio(math.nan, "?").flagged()


def test_the_scale_table_flags_the_cells_past_the_target():
    cells = [
        cell("plain", 512, 1e-3, 1e-3),
        cell("plain", 4096, 1e-3, 1.2e-3),
        cell("plain", 10_000, 1e-3, 1e-3),
        cell("burst", 512, 1e-3, 1e-3),
    ]
    cells[2].base = [Round(1e-3, None)] * 3
    cells[2].series = [Round(1e-3, None)] * 3
    lines = scale_table("v0.20.2", cells, {"plain": "p", "burst": "b"}, 3)
    text = "\n".join(lines)
    plain_4096 = next(x for x in lines if x.startswith("| plain | 4,096 |"))
    assert plain_4096.count("1.20 **!**") == 2  # per step and in total
    assert "| plain | 10,000 | 1.00 | 1.00 | 1.00 | - | - | - | - |" in lines
    assert "plain at 4,096 (step, total)" in text
    slope = fit_exponent([(512, 1.0), (4096, 1.2), (10_000, 1.0)])
    assert f"| plain | p | 0.00 | {slope:.2f} |" in lines  # the exponents
    assert "| burst | b | - | - |" in lines  # one size: no fit


def test_a_longer_step_that_schedules_more_stays_flagged_with_its_per_token_cost():
    # The series drains in half the steps, each scheduling twice the tokens
    # at 1.9x the CPU: per step 1.90, per token 0.95. Still flagged (a step
    # that does more may also cost more per request), named with its cost
    # per token.
    answers = {
        "base": answer([1.0] * 4, drain=40.0, window=4) | {"steps": 40},
        "series": answer([1.9] * 4, drain=38.0, window=4) | {"steps": 20},
    }
    answers["base"]["step_tokens"] = [100] * 4
    answers["series"]["step_tokens"] = [200] * 4
    halved = Cell("offload-tight", 512)
    halved.base = [Round.from_worker(answers["base"])] * 3
    halved.series = [Round.from_worker(answers["series"])] * 3
    assert halved.schedules_differ()
    assert halved.token_ratio() == Ratio(pytest.approx(0.95), "")
    # The same steps at 1.9x the CPU per token: flagged both ways.
    dearer = Cell("offload-tight", 4096)
    dearer.base = [Round.from_worker(answers["base"])] * 3
    series = answers["series"] | {"steps": 40, "step_tokens": [100] * 4}
    dearer.series = [Round.from_worker(series)] * 3
    assert not dearer.schedules_differ()
    lines = scale_table("v0.20.2", [halved, dearer], {"offload-tight": "o"}, 3)
    text = "\n".join(lines)
    row = next(x for x in lines if x.startswith("| offload-tight | 512 |"))
    assert "| 1.90 **!** | 0.95 | 0.95 |" in row
    assert "offload-tight at 512 (step; schedules differ, per token 0.95)" in text
    assert "compare per token and in total): offload-tight at 512." in text
    assert "offload-tight at 4,096 (step, per token)" in text


def test_a_cut_window_has_no_cost_per_token():
    cut = Round.from_worker(
        answer([1.0, 1.0], window=40, cut=True) | {"step_tokens": [5]}
    )
    assert cut.token_seconds is None
    whole = Round.from_worker(answer([1.0, 3.0], drain=4.0) | {"step_tokens": [1, 3]})
    assert whole.token_seconds == 1.0


def test_the_bytecodes_counted_show_as_a_ratio_flagged_past_the_target():
    counted, heavier, uncounted = (cell("p", n, 1e-3, 1e-3) for n in (64, 512, 4096))
    counted.bytecodes = {"base": 1000, "series": 1040}
    heavier.bytecodes = {"base": 1000, "series": 1060}
    assert counted.bytecode_ratio() == "1.040"
    assert heavier.bytecode_ratio() == "1.060 **!**"
    assert uncounted.bytecode_ratio() == "-"
    row = next(
        x
        for x in scale_table("v0.20.2", [counted, heavier], {"p": "p"}, 3)
        if x.startswith("| p | 64 |")
    )
    assert "| 1.040 |" in row
    text = "\n".join(scale_table("v0.20.2", [counted, heavier], {"p": "p"}, 3))
    assert "p at 512 (bytecodes)" in text and "p at 64" not in text


def test_a_cut_cell_shows_bounds_and_its_exponent_too():
    cells = [cell("o", 512, 1e-3, 1e-3), cell("o", 10_000, 1e-3, 1e-3)]
    cells[1].series = [Round(0.5, 20.0, window_cut=True, drain_cut=True)]
    cells[1].base = [Round(2e-2, None)]
    assert cells[1].step_ms("series").show() == ">500.00"
    assert cells[1].step_ratio().show() == ">25.00"
    assert exponent(cells, "series").startswith(">")
    assert exponent(cells, "base") == f"{fit_exponent([(512, 1), (10_000, 20)]):.2f}"


def test_the_serve_table_flags_a_slower_series():
    fast = [ServeRun(100, 1.0, [0.1] * 100, cpu_seconds=1.0)] * 2
    slow = [ServeRun(90, 1.0, [0.2] * 90, errors=10, cpu_seconds=0.9)] * 2
    lines = serve_table("v0.33.0", {"plain": {"base": fast, "series": slow}})
    row = next(x for x in lines if x.startswith("| plain |"))
    assert row == (
        "| plain | 100.0 | 90.0 | 0.90 **!** | 100/100 | 200/200 | 10.0/10.0 "
        "| 1.00 | 0/20 |"
    )
    assert "below 0.98: plain (req/s)." in "\n".join(lines)


def test_a_run_with_no_cpu_read_is_not_measured():
    read = [ServeRun(100, 1.0, [0.1] * 100, cpu_seconds=1.0)] * 2
    unread = [ServeRun(100, 1.0, [0.1] * 100)] * 2
    lines = serve_table("v0.33.0", {"plain": {"base": unread, "series": read}})
    row = next(x for x in lines if x.startswith("| plain |"))
    assert "| -/10.0 | - |" in row
    assert "below" not in "\n".join(lines)


def test_the_serve_table_flags_a_series_that_spends_more_cpu_per_request():
    # Wall time alike (a shared machine), the series' server busier: only
    # the CPU ratio, base per request over series', shows the cost.
    base = [ServeRun(100, 1.0, [0.1] * 100, cpu_seconds=1.0)] * 3
    series = [ServeRun(100, 1.0, [0.1] * 100, cpu_seconds=1.25)] * 3
    lines = serve_table("v0.20.2", {"offload": {"base": base, "series": series}})
    row = next(x for x in lines if x.startswith("| offload |"))
    assert "| 1.00 |" in row
    assert "| 10.0/12.5 | 0.80 **!** |" in row
    assert "below 0.98: offload (CPU)." in "\n".join(lines)


def test_percentiles_interpolate_between_ranks():
    values = [float(x) for x in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0


def test_sizes_and_the_order_of_the_trees():
    assert sizes("4096,64,10_000,64") == [64, 4096, 10_000]
    with pytest.raises(ForkError):
        sizes("64,many")
    with pytest.raises(ForkError):
        sizes("0")
    assert alternate(0) == ("base", "series") and alternate(1) == ("series", "base")


class FakeWorker:
    """Records when it was asked and when it was answered."""

    def __init__(self, kind: str, log: list[str]) -> None:
        self.kind, self.log = kind, log

    def send(self, line: str) -> None:
        self.log.append(f"send {self.kind}")

    def receive(self, what: str) -> dict:
        self.log.append(f"receive {self.kind}")
        return {"kind": self.kind}

    def ask(self, line: str) -> dict:
        self.send(line)
        return self.receive(line)


@pytest.mark.parametrize("r", [0, 1])
def test_both_trees_are_timed_at_once_unless_serial(r):
    log: list[str] = []
    workers = {k: FakeWorker(k, log) for k in ("base", "series")}
    answers = timed(workers, "scale run", r, serial=False)  # type: ignore[arg-type]
    assert answers == {"base": {"kind": "base"}, "series": {"kind": "series"}}
    # Both asked before either answer is read: they run at the same time.
    assert log[:2] == ["send base", "send series"]
    log.clear()
    first, second = alternate(r)
    timed(workers, "scale run", r, serial=True)  # type: ignore[arg-type]
    assert log == [
        f"send {first}",
        f"receive {first}",
        f"send {second}",
        f"receive {second}",
    ]


# The tests run in .venv, which has vLLM's requirements (openai among them).
VENV_PYTHON = Path(sys.executable)


class _Completions(http.server.BaseHTTPRequestHandler):
    """Just enough of /v1/completions for the bench workload."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.hits += 1  # type: ignore[attr-defined]
        body = json.dumps(
            {
                "id": "c",
                "object": "text_completion",
                "created": 0,
                "model": "e2e",
                "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": len(asked["prompt"]),
                    "completion_tokens": asked["max_tokens"],
                    "total_tokens": len(asked["prompt"]) + asked["max_tokens"],
                },
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_one_bench_client_serves_every_run_it_is_given(tmp_path):
    """make bench's server runs go through one client process: a run per
    URL given, each answered in full, to the server named."""
    from prove.bench_serve import Client

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Completions)]
    servers.append(http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Completions))
    for s in servers:
        s.hits = 0  # type: ignore[attr-defined]
        threading.Thread(target=s.serve_forever, daemon=True).start()
    args = argparse.Namespace(serve_requests=5, concurrency=2)
    try:
        with Client(VENV_PYTHON, args, tmp_path / "client.log") as client:
            for s in [servers[0], servers[1], servers[0]]:
                got = client.run(f"http://127.0.0.1:{s.server_address[1]}")
                assert got["outcomes"] == ["ok"] * 5
                assert len(got["latencies"]) == 5
        assert [s.hits for s in servers] == [10, 5]  # type: ignore[attr-defined]
        assert client.proc.returncode == 0
    finally:
        for s in servers:
            s.shutdown()
