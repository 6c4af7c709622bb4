"""Tests written to kill semantic mutants that no reproducer did
(scripts/data/semantic_mutants.toml); make mutate runs this file in the
fast suite of every kind, on every series.
"""

from __future__ import annotations

from harness.burst import burst_of_cpu_hits, within_linear_bound


def test_admitting_a_burst_of_loads_counts_each_prefill_a_bounded_number_of_times():
    """Kills 0008-stale-kept-after-recount: a running total whose stale set
    is never cleared stays exact, but recounts every request that ever
    changed at each admission, the quadratic sum again. Bare 0.19.0-0.22.1
    have no reservation and pass; bare 0.23.0-0.33.0 sum per admission and
    fail (their series' R4 names the same measure as its reproducer)."""
    calls = burst_of_cpu_hits()
    assert within_linear_bound(calls), calls
