"""Reproducer for patch 0008: async KV loads must not strand the scheduler.

A request whose prefix is on the CPU is admitted as an async load: it takes
GPU blocks for the loaded prefix only, after a check that its whole prompt
fits what is free now. Two such requests admitted together can each fit
alone and not both: once the loads land, the head of the queue cannot get
the rest of its prompt, the scan stops there, and with nothing running no
one is preempted. The engine then schedules nothing, forever, with requests
waiting (vllm-project/vllm#45388). Found by the soak (make soak).
"""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_manager_ok, assert_pool_ok

BS = 16
PREFIX_A = [7000 + t for t in range(20 * BS)]
PREFIX_B = [9000 + t for t in range(20 * BS)]


def engine_with_prefixes_on_cpu() -> Engine:
    e = Engine(HarnessConfig(block_size=BS, num_gpu_blocks=64, num_cpu_blocks=256))
    e.add_request(PREFIX_A, max_tokens=3)
    e.add_request(PREFIX_B, max_tokens=3)
    e.run()
    # Only the CPU holds the prefixes now: both requests below load them.
    assert e.block_pool.reset_prefix_cache()
    return e


def test_two_async_loads_that_fit_alone_but_not_together_finish():
    e = engine_with_prefixes_on_cpu()
    # 63 usable blocks. A1 needs 50 (20 loaded), B1 30 (20 loaded): each is
    # admitted (50 <= 63, then 30 <= 43), and after both loads 23 are free,
    # fewer than the 30 A1 still needs.
    a1 = e.add_request(PREFIX_A + [1] * (30 * BS), max_tokens=2)
    b1 = e.add_request(PREFIX_B + [2] * (10 * BS), max_tokens=2)
    try:
        e.run(max_steps=300)
    except AssertionError as exc:
        pytest.fail(f"the scheduler is stuck: {exc}")
    assert {a1, b1} <= e.stats.finished
    assert e.runner.violations == []
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert loads, "A1 and B1 should have loaded their prefixes from the CPU"
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)
    assert_pool_ok(
        e.offload.cpu_block_pool,
        all_done=True,
        label="CPU pool",
        hashed_means_cached=False,
    )
