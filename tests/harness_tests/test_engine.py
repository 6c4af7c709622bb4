"""The harness itself: it runs vLLM's real scheduler and catches bad data."""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_pool_ok

PROMPT_A = list(range(100, 700))
PROMPT_B = list(range(5000, 5600))


def run_three(cfg: HarnessConfig, corrupt_cpu: bool = False) -> Engine:
    """A, then B (evicting A from the GPU), then A extended (hits A on CPU)."""
    e = Engine(cfg)
    e.add_request(PROMPT_A, max_tokens=4)
    e.run()
    e.add_request(PROMPT_B, max_tokens=4)
    e.run()
    if corrupt_cpu:
        for block_id in e.kv.cpu:
            e.kv.cpu[block_id] = ("garbage", block_id)
    e.add_request(PROMPT_A + [7, 8, 9], max_tokens=4)
    e.run()
    return e


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_requests_finish_with_loads_and_consistent_pools(hybrid, lazy):
    cfg = HarnessConfig(
        hybrid=hybrid,
        lazy=lazy,
        num_gpu_blocks=64,
        num_cpu_blocks=256,
        transfer_delay=lambda is_store: 3,
    )
    e = run_three(cfg)
    assert len(e.stats.finished) == 3
    loaded = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert loaded, "the third request should load its prefix from the CPU"
    assert e.runner.violations == []
    assert_pool_ok(e.block_pool, all_done=True, label="GPU pool")
    assert_pool_ok(
        e.offload.cpu_block_pool,
        all_done=True,
        label="CPU pool",
        hashed_means_cached=False,
    )


def test_content_check_catches_a_corrupted_cpu_block():
    cfg = HarnessConfig(num_gpu_blocks=64, num_cpu_blocks=256)
    e = run_three(cfg, corrupt_cpu=True)
    assert e.runner.violations, "loading garbage must be caught by value"
    assert "garbage" in str(e.runner.violations[0])


def test_transfers_complete_when_told():
    cfg = HarnessConfig(
        num_gpu_blocks=64, num_cpu_blocks=64, transfer_delay=lambda is_store: 5
    )
    e = Engine(cfg)
    # Decodes after the prefill: eager mode stores confirmed blocks a step
    # later, so the request must outlive its prefill step.
    e.add_request(list(range(64)), max_tokens=4)
    e.step()
    e.step()
    assert e.offload._store_event_to_blocks, "a store is in flight"
    while e.offload._store_event_to_blocks:
        e.step()
    assert e.stats.steps >= 6
    assert len(e.offload.cpu_block_pool.cached_block_hash_to_block) == 4


def test_without_offload_the_scheduler_runs_alone():
    e = Engine(HarnessConfig(offload=False, num_gpu_blocks=64))
    e.add_request(PROMPT_A, max_tokens=3)
    e.add_request(PROMPT_A[:320], max_tokens=3)
    e.run()
    assert len(e.stats.finished) == 2 and e.runner.violations == []
    assert_pool_ok(e.block_pool, all_done=True)
