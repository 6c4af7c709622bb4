"""Reproducer for the release patch "keep the in-flight prefills'
reservation as a running total" (0.23.0-0.33.0), and a guard for 0008's
running total (0.19.0-0.22.1): what admitting async KV loads costs,
counted in work rather than time.

An async load is admitted only if it leaves free the blocks the prefills
in flight still need. Upstream (from 0.23.0) and the first form of 0008
summed that anew for every load considered: one get_num_blocks_to_allocate
call per in-flight prefill per admission, so a burst of N CPU hits costs
O(N^2) calls in one step (issue 38 measured 1.14 M calls against the
release's 52 k at 4,096 requests, and a 14.8 s step on bare 0.33.0). Kept
as a running total it costs at most one count per request per change, the
order of what allocate_slots itself does. The test counts calls, so it
holds on any machine. It fails on bare 0.23.0-0.33.0 and passes with their
series; bare 0.19.0-0.22.1 have no reservation at all and pass it, as do
their series.
"""

from __future__ import annotations

import pytest

from harness.burst import burst_of_cpu_hits, within_linear_bound


def test_a_burst_of_cpu_hits_counts_each_prefill_a_bounded_number_of_times():
    calls = burst_of_cpu_hits()
    assert within_linear_bound(calls), calls


def test_the_running_total_counts_only_what_changed():
    """InflightPrefills' contract, on its own: a request's need is counted
    when it enters and again only once touched; a read with nothing touched
    counts nothing, whatever the prefills in flight; a candidate in flight
    is left out of its own reserve (a load that failed whole, admitted
    again), one not in flight changes nothing. Skipped where the series has
    no running total (the bare releases)."""
    module = pytest.importorskip("vllm.v1.core.sched.inflight_prefills")
    needs = {f"r{i}": i + 1 for i in range(5)}  # r0 needs 1 block ... r4 5
    counted: list[str] = []

    def count_needed(request: str) -> int:
        counted.append(request)
        return needs[request]

    prefills = module.InflightPrefills(count_needed)
    for request in needs:
        prefills.add(request)
    assert prefills.reserved_blocks() == 15
    assert prefills.reserved_blocks() == 15
    assert sorted(counted) == sorted(needs), "each counted once, then kept"
    needs["r2"] = 10
    prefills.touch("r2")
    assert prefills.reserved_blocks() == 22
    assert counted[5:] == ["r2"], "only the touched request is counted again"
    assert prefills.reserved_blocks(candidate="r4") == 22 - 5
    assert prefills.reserved_blocks(candidate="not in flight") == 22
    prefills.discard("r2")
    assert prefills.reserved_blocks() == 12
    assert len(counted) == 6
