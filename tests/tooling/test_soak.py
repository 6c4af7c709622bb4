"""The soak's speed comparison (scripts/prove/soak.py): the arithmetic on the
timings its workers report. The workers themselves are tested in
tests/harness_tests/test_soak_worker.py."""

from __future__ import annotations

import pytest

from prove.soak import speed_caveat, speed_ratios, speed_verdict, survived

INF = float("inf")


def test_ratio_is_series_over_base_requests_per_second_over_all_seeds():
    timings = {
        "w": {
            "base": [(100, 1.0), (300, 1.0)],
            "series": [(100, 1.25), (300, 2.0)],
        }
    }
    r = speed_ratios(timings)["w"]
    # (requests served, seconds): base 400 / 2 s, series 400 / 3.25 s
    assert r["ratio"] == pytest.approx((400 / 3.25) / (400 / 2), abs=1e-3)
    assert r["seeds"] == 2
    assert r["q1"] <= r["median"] <= r["q3"]
    assert r["median"] == pytest.approx((0.8 + 0.5) / 2, abs=1e-3)


def test_a_seed_without_a_timing_on_either_tree_is_left_out():
    timings = {
        "w": {
            "base": [(100, 1.0), (0, INF), (100, 1.0)],
            "series": [(100, 0.5), (100, 1.0), (100, 0.5)],
        },
        "crashed everywhere": {"base": [(0, INF)], "series": [(10, 1.0)]},
    }
    ratios = speed_ratios(timings)
    assert ratios["w"]["seeds"] == 2
    assert ratios["w"]["ratio"] == pytest.approx(2.0)
    assert "crashed everywhere" not in ratios


def run(**problems) -> dict:
    return {"crash": None, **problems}


def test_survived_allows_silent_problems_only():
    assert survived(run(unordered_stores=3, lost_cpu_blocks=5))
    assert not survived(run(violation_steps=1))
    assert not survived(run(unfinished=2))
    assert not survived({"crash": {"type": "AssertionError"}})


def test_a_base_that_loses_blocks_is_flagged_as_other_work():
    assert speed_caveat({"lost_cpu_blocks": 0}) == ""
    assert "loses 7 CPU blocks" in speed_caveat({"lost_cpu_blocks": 7})


def test_verdict_holds_only_same_work_workloads_to_the_target():
    results = {
        "fast": {"base": {}},
        "slow": {"base": {}},
        "other work": {"base": {"lost_cpu_blocks": 9}},
    }
    ratios = {
        "fast": {"median": 0.97},
        "slow": {"median": 0.9},
        "other work": {"median": 0.5},
    }
    verdict = speed_verdict(ratios, results)
    assert "not on slow (0.9)" in verdict
    assert "other work" not in verdict
    del ratios["slow"]
    assert speed_verdict(ratios, results).endswith("all of fast")
