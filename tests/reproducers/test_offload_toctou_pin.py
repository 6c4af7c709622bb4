"""Reproducer for patch 0003: a CPU hit stays pinned until it is loaded.

The scheduler asks SimpleCPUOffloadScheduler for a request's CPU hit
(get_num_new_matched_tokens), allocates GPU blocks, then registers the load
(update_state_after_alloc). On the base the hit is not held in between:
CPU stores that run in between evict it from the CPU LRU and the second
call asserts "Expected N hit tokens, got 0" (vllm#39702). Here the two
calls are driven as the scheduler makes them, around real CPU-pool
evictions caused by other requests' stores through the real scheduler.
"""

from __future__ import annotations

import pytest

from harness import end_state
from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_pool_ok
from harness.kv_manager import computed_blocks
from harness.offload_checks import cpu_block_of, new_request
from harness.runner import ContentOracle

BS = 16
PROMPT_A = list(range(100, 133))  # two full blocks and one token
PROMPT_C = list(range(300, 333))
PROMPT_D = list(range(500, 533))
PROMPT_E = list(range(700, 749))  # three full blocks and one token


def engine(num_cpu_blocks: int, num_gpu_blocks: int = 32) -> Engine:
    # Eager stores; the CPU pool keeps one block as its null block.
    cfg = HarnessConfig(
        block_size=BS, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks
    )
    return Engine(cfg)


def run_one(e: Engine, prompt: list[int], max_tokens: int = 2) -> str:
    req_id = e.add_request(prompt, max_tokens=max_tokens)
    e.run()
    return req_id


def assert_all_released(e: Engine) -> None:
    assert_pool_ok(e.block_pool, all_done=True, label="GPU pool")
    assert_pool_ok(
        e.offload.cpu_block_pool,
        all_done=True,
        label="CPU pool",
        hashed_means_cached=False,
    )


def test_cpu_hit_evicted_between_match_and_alloc_is_loaded(monkeypatch):
    e = engine(num_cpu_blocks=5)  # four usable CPU blocks
    a = e.requests[run_one(e, PROMPT_A)]
    assert cpu_block_of(e, a, 0) and cpu_block_of(e, a, 1), "A is on the CPU"
    # Drop A from the GPU prefix cache so that only the CPU has it.
    assert e.block_pool.reset_prefix_cache()

    # The scheduler's first call for B (A's prompt): a two-block CPU hit.
    kvm = e.scheduler.kv_cache_manager
    b = new_request(e, PROMPT_A, req_id="b")
    computed, num_local = computed_blocks(kvm, b)
    hit, is_async = e.offload.get_num_new_matched_tokens(b, num_local)
    assert (num_local, hit, is_async) == (0, 2 * BS, True)

    # In between, C and D finish and are stored: four blocks into a CPU
    # pool of four. Unpinned, A's blocks are the LRU ones and get evicted.
    # B's hit stays pinned through their runs (B is driven by hand, outside
    # the scheduler): not a leak, which the end-of-run check would call it.
    monkeypatch.setattr(end_state, "held_cpu_blocks", lambda offload: [])
    run_one(e, PROMPT_C)
    run_one(e, PROMPT_D)

    # The scheduler's second call, after allocating B's blocks.
    assert kvm.allocate_slots(
        b,
        0,
        num_new_computed_tokens=num_local,
        new_computed_blocks=computed,
        num_external_computed_tokens=hit,
        delay_cache_blocks=True,
    )
    e.offload.update_state_after_alloc(b, kvm.get_blocks("b"), hit)

    # B loads A's CPU blocks, and they still hold A's content.
    load = e.offload._reqs_to_load["b"].transfer_meta
    oracle = ContentOracle(BS)
    assert [e.kv.cpu[c] for c in load.cpu_block_ids] == [
        oracle.tag(a, 0, i, BS) for i in range(2)
    ]
    assert load.gpu_block_ids == kvm.get_block_ids("b")[0][:2]

    # B finishes before its load is sent: every ref it took is given back.
    e.offload.request_finished_all_groups(b, kvm.get_block_ids("b"))
    kvm.free(b)
    assert_all_released(e)


def test_pin_is_not_stacked_by_retries_and_is_released_on_abort():
    # B waits behind a long request that holds most of the GPU: each step
    # the scheduler finds B's CPU hit again, and cannot admit B.
    e = engine(num_cpu_blocks=32, num_gpu_blocks=8)
    a = e.requests[run_one(e, PROMPT_A)]
    assert e.block_pool.reset_prefix_cache()
    e.add_request(list(range(1000, 1081)), max_tokens=24)
    e.step()
    b = e.add_request(PROMPT_A, max_tokens=2)
    hit_blocks = [cpu_block_of(e, a, i) for i in range(2)]
    for _ in range(4):
        e.step()
        assert b in e.offload._pinned_cpu_hits
        assert [blk.ref_cnt for blk in hit_blocks] == [1, 1]
    e.abort(b)
    assert b not in e.offload._pinned_cpu_hits
    assert [blk.ref_cnt for blk in hit_blocks] == [0, 0]
    e.run()
    assert e.runner.violations == []
    assert_all_released(e)


def test_pinned_hit_is_loaded_once_the_request_is_admitted():
    e = engine(num_cpu_blocks=32, num_gpu_blocks=8)
    run_one(e, PROMPT_A)
    assert e.block_pool.reset_prefix_cache()
    long = e.add_request(list(range(1000, 1081)), max_tokens=8)
    e.step()
    b = e.add_request(PROMPT_A, max_tokens=3)
    e.run()
    assert e.stats.finished == {"r0", long, b}
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert [len(x["pairs"]) for x in loads] == [2]
    assert e.runner.violations == []
    assert e.offload._pinned_cpu_hits == {}
    assert_all_released(e)


def test_a_partial_take_loads_the_first_blocks_and_unpins_the_rest():
    """The scheduler may allocate fewer external tokens than the hit it was
    told (a group that needs a shorter hit): the load takes the hit's first
    blocks after the GPU's own hits, holding one ref on each, and the pin
    on the rest is given back. E's first block is a GPU hit, the next two
    are on the CPU; B takes one of them."""
    e = engine(num_cpu_blocks=8)
    a = e.requests[run_one(e, PROMPT_E)]
    assert e.block_pool.reset_prefix_cache()
    run_one(e, PROMPT_E[:BS] + [1, 2, 3])  # E's first block back on the GPU
    kvm = e.scheduler.kv_cache_manager
    b = new_request(e, PROMPT_E, req_id="b")
    computed, num_local = computed_blocks(kvm, b)
    hit, _ = e.offload.get_num_new_matched_tokens(b, num_local)
    assert (num_local, hit) == (BS, 2 * BS)
    pinned = [cpu_block_of(e, a, i) for i in (1, 2)]
    assert [blk.ref_cnt for blk in pinned] == [1, 1]

    assert kvm.allocate_slots(
        b,
        0,
        num_new_computed_tokens=num_local,
        new_computed_blocks=computed,
        num_external_computed_tokens=BS,
        delay_cache_blocks=True,
    )
    e.offload.update_state_after_alloc(b, kvm.get_blocks("b"), BS)

    load = e.offload._reqs_to_load["b"].transfer_meta
    assert load.cpu_block_ids == [pinned[0].block_id]
    assert load.gpu_block_ids == [kvm.get_block_ids("b")[0][1]]
    assert [blk.ref_cnt for blk in pinned] == [1, 0], "only the load's ref"
    assert "b" not in e.offload._pinned_cpu_hits
    e.offload.request_finished_all_groups(b, kvm.get_block_ids("b"))
    kvm.free(b)
    assert_all_released(e)


def test_a_take_of_more_than_the_hit_is_an_error_that_unpins():
    """More external tokens than get_num_new_matched_tokens() found is a
    caller's bug: a clear error naming both numbers, and no pin left."""
    e = engine(num_cpu_blocks=8)
    a = e.requests[run_one(e, PROMPT_A)]
    assert e.block_pool.reset_prefix_cache()
    b = new_request(e, PROMPT_A, req_id="b")
    e.offload.get_num_new_matched_tokens(b, 0)
    kvm = e.scheduler.kv_cache_manager
    assert kvm.allocate_slots(
        b, 0, num_external_computed_tokens=3 * BS, delay_cache_blocks=True
    )
    with pytest.raises(RuntimeError, match=f"{3 * BS} external tokens.* {2 * BS} "):
        e.offload.update_state_after_alloc(b, kvm.get_blocks("b"), 3 * BS)
    assert [cpu_block_of(e, a, i).ref_cnt for i in range(2)] == [0, 0]


def test_a_take_with_no_hit_found_is_an_error():
    """External tokens for a request get_num_new_matched_tokens() found no
    CPU hit for: the same clear error, saying so."""
    e = engine(num_cpu_blocks=8)
    b = new_request(e, PROMPT_A, req_id="b")
    kvm = e.scheduler.kv_cache_manager
    assert kvm.allocate_slots(
        b, 0, num_external_computed_tokens=2 * BS, delay_cache_blocks=True
    )
    with pytest.raises(RuntimeError, match="found no CPU hit tokens"):
        e.offload.update_state_after_alloc(b, kvm.get_blocks("b"), 2 * BS)
