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

import inspect

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_manager_ok, assert_pool_ok
from harness.offload_checks import loads_in_flight_engine

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
    e.run(max_steps=300)  # raises where the scheduler is stuck
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


# A streaming-input session keeps its KV while it waits for its next chunk,
# with no connector at all. Nothing about async loads may touch it.
SESSION_1 = [100 + t for t in range(3 * BS)]
SESSION_2 = [200 + t for t in range(3 * BS)]
NEXT_CHUNK = [1, 2, 3, 4]


def test_idle_streaming_session_keeps_its_kv_with_no_connector():
    """Two idle sessions hold 6 of 9 usable blocks and a 64-token request
    that needs 4 waits, with nothing running. The unpatched release keeps
    waiting: the sessions keep their KV and their history. A release of
    waiting requests' blocks (an earlier form of 0008) freed the second
    session and zeroed its computed tokens, so its next chunk replaced the
    conversation instead of extending it."""
    e = Engine(
        HarnessConfig(
            block_size=BS, num_gpu_blocks=10, offload=False, prefix_caching=False
        )
    )
    s1 = e.add_request(SESSION_1, max_tokens=1, resumable=True)
    s2 = e.add_request(SESSION_2, max_tokens=1, resumable=True)
    e.step()
    session = e.requests[s2]
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    held = e.scheduler.kv_cache_manager.get_block_ids(s2)
    assert [len(ids) for ids in held] == [3]

    h = e.add_request([300 + t for t in range(4 * BS)], max_tokens=1)
    for _ in range(5):
        e.step()
    assert e.requests[h].num_computed_tokens == 0, "4 blocks cannot be free yet"
    assert e.scheduler.kv_cache_manager.get_block_ids(s2) == held
    assert session.num_computed_tokens == len(SESSION_2)

    e.add_request(NEXT_CHUNK, max_tokens=1, req_id=s2, resumable=True)
    assert list(session.all_token_ids) == SESSION_2 + NEXT_CHUNK
    assert session.num_computed_tokens == len(SESSION_2)
    # The chunk runs on the session's KV: every block it attends to is read
    # and checked by value.
    e.step()
    assert session.num_computed_tokens == len(SESSION_2) + len(NEXT_CHUNK)
    assert e.runner.violations == [], e.runner.violations[0]

    # End both sessions (a request that is not resumable ends one): H runs.
    for sid in (s1, s2):
        e.scheduler.add_request(
            Request(
                request_id=sid,
                prompt_token_ids=[0],
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
            )
        )
    e.run(max_steps=50)
    assert h in e.stats.finished
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_an_async_load_that_failed_whole_is_admitted_again():
    """A load that fails whole (kv_load_failure_policy="recompute") gives
    the request's blocks back and the request is admitted as a load again.
    Its own prompt must not count against it: reserving it would refuse a
    prompt that needs more than half of what is free, forever, with
    nothing running (upstream's gate as first written does that)."""
    e = loads_in_flight_engine()
    e.add_request(PREFIX_A, max_tokens=3)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    # 50 of 63 usable blocks, 20 of them loaded from the CPU.
    a1 = e.add_request(PREFIX_A + [1] * (30 * BS), max_tokens=2)
    e.fail_next_load(a1)
    e.run(max_steps=300)  # raises where the scheduler is stuck
    assert a1 in e.stats.finished
    assert not e._failing_loads, "the load should have failed once"
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def check_inflight_prefills(e: Engine) -> None:
    """after_step: the scheduler's in-flight prefills (0008's, and upstream's
    from 0.24.0) are requests still prefilling: loading, waiting to be
    scheduled after their load, or running a prefill chunk that does not
    end the prompt. A request that is done prefilling, preempted or
    finished would reserve blocks it does not need."""
    for req in getattr(e.scheduler, "_inflight_prefills", ()):
        prefilling = req.status == RequestStatus.RUNNING and req.is_prefill_chunk
        waiting = req.status in (
            RequestStatus.WAITING_FOR_REMOTE_KVS,
            RequestStatus.WAITING,
        )
        assert prefilling or waiting, (
            f"step {e.stats.steps}: {req.request_id} is in flight but "
            f"{req.status.name}, {req.num_computed_tokens} of "
            f"{req.num_tokens} tokens computed"
        )


def engine_with_prefix_b_on_cpu(
    load_delay: int = 0, chunk: int = 0, policy: str = "fcfs"
) -> Engine:
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=64,
            num_cpu_blocks=256,
            long_prefill_token_threshold=chunk,
            policy=policy,
            transfer_delay=lambda is_store: 0 if is_store else load_delay,
        )
    )
    e.add_request(PREFIX_B + [5] * (4 * BS), max_tokens=2)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    return e


# 24 blocks of prefix B on the CPU (the first 24 of PREFIX_B's request).
LOAD_B = PREFIX_B + [5] * (4 * BS)


def test_an_async_load_waits_for_an_inflight_chunked_prefill():
    """A chunked prefill in flight still needs its blocks: an async load that
    would take them waits (upstream's design: "avoid deadlock and
    predictable preemptions"). A's chunks are 4 blocks, half the step's
    budget, so B is looked at while A prefills. After A's first chunk 59
    blocks are free and A needs 36 more; B's load of 24 would leave 35.
    Admitted, and slow to land, it takes the blocks A's next chunks need,
    and A is preempted."""
    e = engine_with_prefix_b_on_cpu(load_delay=10, chunk=4 * BS)
    a = e.add_request([8000 + t for t in range(40 * BS)], max_tokens=2)
    e.step()
    assert e.requests[a].num_computed_tokens > 0
    b = e.add_request(LOAD_B + [6] * (6 * BS), max_tokens=2)
    e.run(max_steps=300, after_step=check_inflight_prefills)
    assert {a, b} <= e.stats.finished
    assert e.stats.preemptions == 0
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert loads, "B should have loaded its prefix from the CPU"
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_an_aborted_prefill_reserves_nothing():
    """A request aborted mid-prefill leaves the in-flight prefills: its
    blocks are free, and an async load that needs them is admitted. (Kept
    in flight, its 52 blocks still to come would refuse every load of more
    than 11, forever, with nothing running.)"""
    e = engine_with_prefix_b_on_cpu()
    a = e.add_request([8000 + t for t in range(60 * BS)], max_tokens=2)
    e.step()
    e.abort(a)
    b = e.add_request(LOAD_B + [6] * (6 * BS), max_tokens=2)
    e.run(max_steps=300)  # raises where the scheduler is stuck
    assert b in e.stats.finished
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_a_preempted_prefill_reserves_nothing():
    """A request preempted mid-prefill gives its blocks back and leaves the
    in-flight prefills until it is scheduled again. Priority scheduling
    puts a load ahead of it: A (priority 1, 40 blocks) and D (priority 0,
    30 blocks) prefill in chunks until the pool is full and A, the lower
    priority, is preempted with 35 blocks free; C (priority 0) then loads a
    30-block prompt. (Kept in flight, A's 40 blocks would refuse C forever,
    and with C refused nothing behind it is looked at.)"""
    e = engine_with_prefix_b_on_cpu(chunk=4 * BS, policy="priority")
    a = e.add_request([8000 + t for t in range(40 * BS)], max_tokens=2, priority=1)
    e.step()
    e.add_request([6000 + t for t in range(30 * BS)], max_tokens=2)
    while not e.stats.preemptions:
        assert e.stats.steps < 100, "A was never preempted"
        e.step()
        check_inflight_prefills(e)
    assert e.scheduler.requests[a].status == RequestStatus.PREEMPTED
    c = e.add_request(LOAD_B + [6] * (6 * BS), max_tokens=2)
    e.run(max_steps=300, after_step=check_inflight_prefills)
    assert {a, c} <= e.stats.finished
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_an_async_load_that_fits_exactly_beside_an_inflight_prefill_is_admitted():
    """The boundary of the case above: A's prompt is one block shorter, so
    after A's first chunk B's load of 24 leaves exactly the 35 blocks A
    still needs. B is admitted then, while A prefills, and nothing is
    preempted. (A samples one token: its prompt fills its last block, and a
    second token would need a block no reservation promised.)"""
    e = engine_with_prefix_b_on_cpu(load_delay=10, chunk=4 * BS)
    a = e.add_request([8000 + t for t in range(39 * BS)], max_tokens=1)
    e.step()
    b = e.add_request(LOAD_B + [6] * (6 * BS), max_tokens=2)
    e.step()
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert loads, "B's load should start beside A's prefill"
    assert e.requests[a].num_computed_tokens < e.requests[a].num_tokens
    e.run(max_steps=300, after_step=check_inflight_prefills)
    assert {a, b} <= e.stats.finished
    assert e.stats.preemptions == 0
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_a_prompt_may_take_the_last_free_block():
    """Admission reserves nothing when no load is in play: a prompt that
    needs every free block is admitted at once."""
    e = Engine(
        HarnessConfig(
            block_size=BS, num_gpu_blocks=9, offload=False, max_num_batched_tokens=128
        )
    )
    whole = e.add_request([100 + t for t in range(8 * BS)], max_tokens=1)
    e.step()
    assert e.requests[whole].num_computed_tokens == 8 * BS
    e.run(max_steps=20)
    assert whole in e.stats.finished
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_a_prompt_one_block_larger_than_the_free_pool_waits():
    """The other side of that boundary: a prompt that needs one block more
    than is free waits for it, without asking the pool for it (the harness
    fails a request for more blocks than an unshared pool has free). With
    the whole-prompt check off, allocate_slots's own count decides."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=9,
            offload=False,
            max_num_batched_tokens=128,
            reserve_full_isl=False,
        )
    )
    first = e.add_request([100 + t for t in range(3 * BS - 4)], max_tokens=3)
    e.step()
    free = e.block_pool.get_num_free_blocks()
    larger = e.add_request([500 + t for t in range(free * BS + 1)], max_tokens=1)
    e.step()
    assert e.requests[larger].num_computed_tokens == 0
    e.run(max_steps=20)
    assert {first, larger} <= e.stats.finished
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_an_inflight_prefill_reserves_only_its_window_of_sliding_window_blocks():
    """A hybrid model's sliding-window group drops blocks behind the window
    as a prefill goes on, so an in-flight prefill reserves only what its
    window can hold at once there (the admission cap), not a block per
    prompt block: beside A's 40-block prefill B's load is admitted at once
    (counting A's window blocks whole would keep it waiting until A ends).
    Up to 0.20.1 vLLM has no admission cap (its own full-sequence gate
    counts the whole window group too), and neither does the series."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    gnbta = inspect.signature(KVCacheCoordinator.get_num_blocks_to_allocate)
    if "apply_admission_cap" not in gnbta.parameters:
        pytest.skip("this release has no admission cap for sliding windows")
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=96,
            num_cpu_blocks=256,
            hybrid=True,
            sliding_window=3 * BS,
            long_prefill_token_threshold=4 * BS,
            transfer_delay=lambda is_store: 0 if is_store else 10,
        )
    )
    e.add_request(LOAD_B, max_tokens=2)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    a = e.add_request([8000 + t for t in range(40 * BS)], max_tokens=2)
    e.step()
    b = e.add_request(LOAD_B + [6] * (6 * BS), max_tokens=2)
    e.step()
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert loads, "B's load should start beside A's prefill"
    assert e.requests[a].num_computed_tokens < e.requests[a].num_tokens
    e.run(max_steps=300, after_step=check_inflight_prefills)
    assert {a, b} <= e.stats.finished
    assert e.stats.preemptions == 0
    assert e.runner.violations == []


def test_with_no_connector_an_admission_beside_an_inflight_prefill_is_unchanged():
    """The reservation applies to async loads only. With no connector, a
    long prompt prefilled in capped chunks leaves budget in each step, and
    a new request is admitted beside it at once, as the release does: its
    first chunk (2 blocks) fits what is free, though not what is free less
    the 16 blocks the prefill in flight still needs."""
    cfg = HarnessConfig(
        block_size=BS,
        num_gpu_blocks=20,
        offload=False,
        max_num_batched_tokens=128,
        long_prefill_token_threshold=2 * BS,
    )
    e = Engine(cfg)
    long = e.add_request(list(range(1000, 1000 + 18 * BS)), max_tokens=1)
    e.step()  # its first chunk: 2 of its 18 blocks
    free = e.block_pool.get_num_free_blocks()
    assert 2 <= free < 2 + 16
    short = e.add_request(list(range(5000, 5000 + 5 * BS)), max_tokens=1)
    so = e.step()
    assert {long, short} <= set(so.num_scheduled_tokens)
    e.run()
    assert e.stats.finished == {long, short}
