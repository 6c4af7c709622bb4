"""Reproducer for patch 0010: waiting requests that hold KV blocks do not
deadlock the engine.

A streaming session keeps the KV blocks of what it computed while it waits
for its next input, and keeps them while that input waits to be scheduled.
Two sessions each given a longer input can each need more blocks than are
free, the rest being held by the other: the waiting scan stops at the
first, nothing runs, no step frees a block, and the engine schedules
nothing, forever, with both waiting and no error. Every bare release from
0.19.0 to 0.33.0 stalls so (the differential oracle's "mixed" traces
found it: 30 of 400 generated traces on bare 0.33.0).
"""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_manager_ok

BS = 16


def sessions_holding_most_blocks(policy: str) -> tuple[Engine, str, str]:
    """19 usable blocks; sessions A and B have each computed a 120-token
    prompt and hold 8 blocks, so 3 are free."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=20,
            offload=False,
            policy=policy,
            max_num_batched_tokens=256,
        )
    )
    a = e.add_request([100 + t for t in range(120)], 1, "A", resumable=True)
    b = e.add_request([300 + t for t in range(120)], 1, "B", resumable=True, priority=1)
    for _ in range(3):
        e.step()
    free = e.block_pool.get_num_free_blocks()
    assert free < 4 and not e.scheduler.running, (
        f"both sessions should idle holding their blocks ({free} free)"
    )
    return e, a, b


def computed(e: Engine, req_id: str) -> int:
    return e.scheduler.requests[req_id].num_computed_tokens


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_sessions_that_hold_blocks_do_not_deadlock(policy):
    e, a, b = sessions_holding_most_blocks(policy)
    # Each session's next input: 60 tokens more, 4 blocks more than free.
    e.add_request([500 + t for t in range(60)], 2, a, resumable=True, priority=0)
    e.add_request([700 + t for t in range(60)], 2, b, resumable=True, priority=1)
    for _ in range(10):
        e.step()
    # B (last in either order) gave its blocks back; A ran its input and
    # idles again, holding 12 blocks. B fits only once A has ended.
    assert computed(e, a) > 120, "the scheduler is stuck: neither input ran"
    e.add_request([0], 1, a)  # A's end
    for _ in range(10):
        e.step()
    assert computed(e, b) > 120, "B's input did not run after A ended"
    e.add_request([0], 1, b)
    e.run(max_steps=100)
    assert {a, b} <= e.stats.finished
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_an_idle_session_keeps_its_blocks():
    # A waits for blocks that idle session B holds. B's client may still
    # send its next input, so B's KV stays until B ends; then A runs.
    e, a, b = sessions_holding_most_blocks("fcfs")
    e.add_request([500 + t for t in range(60)], 2, a, resumable=True)
    held = e.scheduler.kv_cache_manager.get_block_ids(b)
    for _ in range(5):
        e.step()
    assert e.scheduler.kv_cache_manager.get_block_ids(b) == held
    assert computed(e, a) == 120
    e.add_request([0], 1, b)  # B's end
    for _ in range(5):
        e.step()
    assert computed(e, a) > 120
    e.add_request([0], 1, a)
    e.run(max_steps=100)
    assert {a, b} <= e.stats.finished
    assert e.runner.violations == []
