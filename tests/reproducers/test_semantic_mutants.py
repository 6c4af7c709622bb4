"""Tests written to kill mutants that no reproducer did: semantic mutants
(scripts/data/semantic_mutants.toml) and hunk reverts. make mutate runs
this file in the fast suite of every kind, on every series.
"""

from __future__ import annotations

import pytest
from vllm.v1.core import single_type_kv_cache_manager as managers
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import RequestStatus

from harness.burst import burst_of_cpu_hits, within_linear_bound
from harness.invariants import assert_manager_ok
from harness.offload_checks import loads_in_flight_engine


def test_admitting_a_burst_of_loads_counts_each_prefill_a_bounded_number_of_times():
    """Kills 0008-stale-kept-after-recount: a running total whose stale set
    is never cleared stays exact, but recounts every request that ever
    changed at each admission, the quadratic sum again. Bare 0.19.0-0.22.1
    have no reservation and pass; bare 0.23.0-0.33.0 sum per admission and
    fail (their series' R4 names the same measure as its reproducer)."""
    calls = burst_of_cpu_hits()
    assert within_linear_bound(calls), calls


BS = 16
BLOCKS_PER_REQUEST = 4


def hot_manager(num_gpu_blocks: int):
    """HiSparse's hot-region manager alone, on a pool of its own."""
    hot = getattr(managers, "HiSparseHotManager", None)
    if hot is None or not hasattr(hot, "mark_allocation"):
        pytest.skip("no HiSparse hot region, or no undo of a refused call")
    from vllm.v1.kv_cache_interface import HiSparseHotSpec

    pool = BlockPool(
        num_gpu_blocks=num_gpu_blocks, enable_caching=False, hash_block_size=BS
    )
    spec = HiSparseHotSpec(
        block_size=BS, page_size=1, blocks_per_request=BLOCKS_PER_REQUEST
    )
    return hot(
        spec,
        block_pool=pool,
        enable_caching=False,
        kv_cache_group_id=0,
        scheduler_block_size=BS,
    )


def group_state(manager) -> tuple:
    """What an allocation of the group changes."""
    return (
        {r: [b.block_id for b in bs] for r, bs in manager.req_to_blocks.items() if bs},
        dict(manager.num_cached_block),
        list(manager.new_block_ids),
        manager.block_pool.get_num_free_blocks(),
    )


def test_refused_hot_region_leaves_the_request_unregistered():
    """Kills 0002-restore-forgets-cached-count (0.33.0): HiSparse's hot-region
    manager (0.30.0 on) registers a cold request (its num_cached_block
    entry) inside allocate_new_blocks, before it asks the pool for the
    region; every other group registers only where prefix hits or external
    tokens are added, and a refused call that registered the request frees
    it whole. Left behind, the entry makes the retry read as a running
    request: the coordinator skips adding its prefix hits. The harness
    cannot build a HiSparse engine (its host pool and coordinator), so this
    drives the group's manager through the undo allocate_slots uses (mark,
    refused allocation, undo). Skipped on trees without the group or the
    undo (every bare release)."""
    # The null block takes one of 4: 3 free, one short of the region.
    manager = hot_manager(num_gpu_blocks=BLOCKS_PER_REQUEST)
    manager.require_hot("cold")
    before = group_state(manager)
    mark = manager.mark_allocation("cold")
    with pytest.raises(ValueError):
        manager.allocate_new_blocks("cold", 4 * BS, 4 * BS)
    manager.undo_allocation(mark)
    assert "cold" not in manager.num_cached_block, (
        "the refused call's registration outlived its undo: the retry is "
        "taken for a running request"
    )
    assert group_state(manager) == before


def test_granted_hot_region_keeps_the_registration():
    # The undo is for refusals only: a call the pool grants registers the
    # request and holds the whole region.
    manager = hot_manager(num_gpu_blocks=BLOCKS_PER_REQUEST + 1)
    manager.require_hot("cold")
    blocks = manager.allocate_new_blocks("cold", 4 * BS, 4 * BS)
    assert len(blocks) == BLOCKS_PER_REQUEST
    assert manager.num_cached_block["cold"] == 0
    assert manager.has_hot("cold")


def test_a_load_failed_by_request_is_recounted_and_recomputed():
    """Kills the revert of the in-flight prefills' mark in
    `_handle_failed_recving` (0.30.0 on; the running total's patch, R4 on
    0.33.0): a connector that names the failed request (Mooncake's
    failed_recving) sets its computed tokens to 0 under the "recompute"
    policy, a change the running total must hear of. The harness's
    reservation check fails after update_from_output on an unmarked change
    (harness/reservation_check.py); the SimpleCPUOffload worker reports
    failed blocks, never failed requests, so no other test takes this path.
    Skipped before 0.30.0 (no failed_recving)."""
    e = loads_in_flight_engine(load_steps=2)
    prefixes = [[base + t for t in range(8 * BS)] for base in (5000, 6000)]
    for prefix in prefixes:
        e.add_request(prefix, max_tokens=1)
    e.run()
    # Only the CPU holds the prefixes now: the requests below load them.
    assert e.block_pool.reset_prefix_cache()
    failing = e.add_request(prefixes[0] + [1] * (2 * BS), max_tokens=2)
    try:
        e.fail_next_load(failing, by_request=True)
    except NotImplementedError as no_field:
        pytest.skip(str(no_field))
    e.step()
    # Admitted while the first loads, the second's admission reads the
    # reservation, which counts the first; the first's load fails after.
    other = e.add_request(prefixes[1] + [2] * (2 * BS), max_tokens=2)
    e.step()
    request = e.scheduler.requests[failing]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    prefills = e.scheduler._inflight_prefills
    if hasattr(prefills, "needed"):  # the series' running total
        assert request in prefills.needed and request not in prefills._stale, (
            "the failing load must be counted before it fails, or no mark matters"
        )
    e.run(max_steps=100)
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert len(loads) == 3, "the failed load, the other, then the first again"
    assert {failing, other} <= e.stats.finished
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)
