"""The invariant checks and the peer engine catch what they claim to."""

from __future__ import annotations

from harness.engine import Engine, HarnessConfig
from harness.invariants import manager_snapshot, manager_violations, pool_violations
from harness.peer import PeerEngine


def running_engine() -> Engine:
    e = Engine(HarnessConfig(offload=False, hybrid=True, num_gpu_blocks=64))
    e.add_request(list(range(100, 300)), max_tokens=20)
    for _ in range(3):
        e.step()
    return e


def test_manager_checks_pass_on_a_healthy_engine():
    e = running_engine()
    assert manager_violations(e.scheduler.kv_cache_manager) == []
    e.run()
    assert manager_violations(e.scheduler.kv_cache_manager, all_done=True) == []


def test_manager_checks_catch_a_block_held_without_a_reference():
    e = running_engine()
    manager = e.scheduler.kv_cache_manager
    req_id = next(iter(e.scheduler.requests))
    block = manager.coordinator.single_type_managers[0].req_to_blocks[req_id][0]
    block.ref_cnt -= 1
    problems = manager_violations(manager)
    assert any(f"block {block.block_id} is held 1 times" in p for p in problems)


def test_manager_checks_catch_a_block_in_two_groups():
    e = running_engine()
    manager = e.scheduler.kv_cache_manager
    req_id = next(iter(e.scheduler.requests))
    full, swa = manager.coordinator.single_type_managers
    swa.req_to_blocks[req_id].append(full.req_to_blocks[req_id][0])
    assert any("is held in groups 0 and 1" in p for p in manager_violations(manager))


def test_manager_checks_catch_requests_left_at_the_end():
    e = running_engine()
    assert any(
        "still tracks requests" in p
        for p in manager_violations(e.scheduler.kv_cache_manager, all_done=True)
    )


def test_pool_checks_catch_a_block_appended_twice():
    # What seed 000's double free does to the free queue.
    e = running_engine()
    pool = e.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    pool.free_block_queue.append(free[0])
    assert pool_violations(pool)


def test_peer_takes_blocks_at_the_armed_call_and_gives_them_back():
    e = Engine(HarnessConfig(offload=False, num_gpu_blocks=32))
    pool = e.block_pool
    peer = PeerEngine(pool)
    before = manager_snapshot(e.scheduler.kv_cache_manager)
    peer.arm(after_calls=1)
    served = pool.get_new_blocks(2)  # call 0: served
    assert not peer.held
    free = pool.get_num_free_blocks()
    try:
        pool.get_new_blocks(3)  # call 1: the peer leaves 2 of `free`
    except ValueError:
        pass
    else:
        raise AssertionError("the struck call should have been short")
    assert len(peer.held) == free - 2 and peer.strikes == [(1, 3)]
    peer.release()
    assert pool.get_num_free_blocks() == free
    pool.free_blocks(served)
    assert manager_snapshot(e.scheduler.kv_cache_manager) == before
