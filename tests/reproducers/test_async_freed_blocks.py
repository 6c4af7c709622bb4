"""Reproducer for patch 0011: under async scheduling, a request's blocks go
back to the pool only once the step in flight that computes it is done.

With async scheduling, step N+1 is launched before step N's output is
processed. A request that stops in step N (a stop token) was already
scheduled in step N+1, whose forward, still running on the GPU, reads and
writes its blocks. Releases before 0.24.0 free them as soon as step N is
processed; the next schedule hands them to a request that hits the CPU
cache, and SimpleCPUOffload's load, on its own stream, writes them
unordered with that forward: the loaded KV, or the forward's, is garbled,
silently (upstream defers the free from 0.24.0, vllm#45357). On a CPU the
fake CUDA's happens-before checker (harness.fake_cuda) reports the pair.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_pool_ok
from harness.offload_checks import load_races

BS = 16
PREFIX = list(range(100, 100 + 4 * BS + 3))
# Fills all but one block of the pool, so the load must reuse its blocks.
LONG = list(range(5000, 5000 + 13 * BS))


def run_stop_then_hit(async_scheduling: bool) -> tuple[Engine, set[int], set[int]]:
    """PREFIX is computed and offloaded, then dropped from the GPU cache.
    A long request stops on a token it samples; then PREFIX comes again,
    hits the CPU cache, and is loaded into blocks the long one held.
    Returns the engine, the long request's blocks and the loaded blocks."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=16,
            num_cpu_blocks=64,
            async_scheduling=async_scheduling,
        )
    )
    e.add_request(PREFIX, max_tokens=2)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    long = e.add_request(LONG, max_tokens=40, stop_at=len(LONG) + 5)
    for _ in range(4):
        e.step()
    (held,) = e.scheduler.kv_cache_manager.get_block_ids(long)
    e.add_request(PREFIX + [7, 8], max_tokens=3)
    e.run()
    loaded = {
        d for x in e.copy_backend.launched if not x["is_store"] for _, d in x["pairs"]
    }
    return e, set(held), loaded


def test_a_load_never_overwrites_blocks_a_step_in_flight_uses():
    e, held, loaded = run_stop_then_hit(async_scheduling=True)
    assert held & loaded, "the load reused the stopped request's blocks"
    assert load_races(e) == []
    assert e.runner.violations == []
    assert e.stats.finished >= set(e.requests)


def test_synchronous_scheduling_is_unchanged():
    """Without async scheduling nothing is in flight when blocks are freed:
    the free is immediate, and the same blocks are reused the same way."""
    e, held, loaded = run_stop_then_hit(async_scheduling=False)
    assert held & loaded
    assert load_races(e) == []
    assert not getattr(e.scheduler, "deferred_frees", ())


def test_no_request_is_preempted_for_blocks_it_cannot_give_back_yet():
    """Under async scheduling the blocks of a request a step in flight
    computes come back only once that step is processed: preempting it
    frees nothing now, and every running request after it would be
    preempted too, for nothing (the differential's async-mixed trace 23:
    three requests preempted in one step that scheduled nothing). Replays
    that trace and checks every preemption the scheduler makes."""
    from harness import trace_worker
    from harness.traces import FAMILIES

    trace = FAMILIES["async-mixed"](23)
    e = trace_worker.engine_for(trace)
    s = e.scheduler
    preempt = s._preempt_request
    futile: list[str] = []

    def checked_preempt(request, *args, **kwargs):
        can_free = getattr(s, "_request_blocks_can_be_freed", lambda r: True)
        if getattr(s, "defer_block_free", False) and not can_free(request):
            futile.append(f"step {e.stats.steps}: {request.request_id}")
        return preempt(request, *args, **kwargs)

    s._preempt_request = checked_preempt
    for step in range(trace_worker.MAX_STEPS):
        for event in trace.events.get(step, ()):
            trace_worker.deliver(e, event)
        if step > trace.last_step() and not e.busy():
            break
        e.step()
    assert futile == []
    assert not e.busy()


def test_the_prefix_cache_resets_while_frees_wait_for_a_step_in_flight():
    """Blocks whose free waits for a step in flight hold no prefix any
    request can reach: resetting the prefix cache (after a weight update,
    or to sleep) succeeds as on the release, both when a request just
    stopped with its next step in flight and when every running request
    is preempted for the reset; the blocks come back without a hash."""
    e = Engine(
        HarnessConfig(
            block_size=BS, num_gpu_blocks=32, num_cpu_blocks=64, async_scheduling=True
        )
    )
    s = e.scheduler
    stopped = e.add_request(list(range(100, 100 + 2 * BS)), 40, stop_at=2 * BS + 3)
    while stopped in s.requests:
        e.step()
    assert s.reset_prefix_cache()

    for i in range(1, 4):
        e.add_request(list(range(1000 * i, 1000 * i + BS + 3)), max_tokens=50)
    for _ in range(6):
        e.step()
    assert s.running and e.in_flight
    assert s.reset_prefix_cache(reset_running_requests=True)
    e.run()
    assert len(e.stats.finished) == 4
    assert e.block_pool.get_num_free_blocks() == 31


def test_a_reset_counts_a_block_only_if_every_reference_to_it_waits():
    """The reset's count, on the pool itself: a deferred block that a live
    request shares (its ref_cnt above the holds) still counts as used; one
    held twice by deferred frees counts once; the null block never counts;
    where a group can have a pool of its own (0.30.0 on), another pool's
    block with the same id is no hold. The reset of 0011 (0.19.0-0.23.0)
    and of the fix written onto upstream's deferral (0.24.0-0.33.0)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS)
    blocks = pool.get_new_blocks(2)
    pool.touch([blocks[0]])  # a live request shares the first block
    assert not pool.reset_prefix_cache(held_blocks=blocks)
    if hasattr(KVCacheCoordinator, "reset_prefix_cache"):  # several pools
        other = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS)
        (foreign,) = other.get_new_blocks(1)
        assert foreign.block_id == blocks[0].block_id
        assert not pool.reset_prefix_cache(held_blocks=[foreign, *blocks])
        # A larger pool's block with an id past this pool's last.
        big = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BS)
        beyond = big.get_new_blocks(len(pool.blocks))[-1]
        assert beyond.block_id == len(pool.blocks)
        assert not pool.reset_prefix_cache(held_blocks=[beyond, *blocks])
    pool.free_blocks([blocks[0]])  # it lets go: the deferred free holds both
    assert not pool.reset_prefix_cache(held_blocks=blocks[1:])
    pool.touch([blocks[1]])  # two deferred frees of one block
    pool.null_block.ref_cnt = 1  # its ref_cnt is not kept: any value
    assert pool.reset_prefix_cache(
        held_blocks=[pool.null_block, blocks[0], blocks[1], blocks[1]]
    )


def test_deferred_blocks_come_back_once_their_step_is_processed():
    """A request that stops with its next step in flight gives its blocks
    back when that step's output is processed, not a step later: it is
    the last step the engine runs, so a late drain would keep them out of
    the pool for good."""
    e = Engine(
        HarnessConfig(
            block_size=BS, num_gpu_blocks=16, num_cpu_blocks=64, async_scheduling=True
        )
    )
    s = e.scheduler
    stopped = e.add_request(PREFIX, max_tokens=40, stop_at=len(PREFIX) + 2)
    while stopped in s.requests and not e.stats.finished:
        e.step()
    assert e.in_flight, "its next step is in flight when it stops"
    e.run()
    assert not getattr(s, "deferred_frees", ())
    assert_pool_ok(e.block_pool, all_done=True, label="GPU pool")


@pytest.mark.parametrize("overlap", ["async", "pipeline-2"])
def test_a_load_never_overwrites_blocks_of_a_request_aborted_in_flight(overlap):
    """A request aborted while a step that computes it is in flight (with
    async scheduling, or a second pipeline stage) gives its blocks back
    only once that step is processed: a load into them before then would
    race the forward."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=16,
            num_cpu_blocks=64,
            async_scheduling=overlap == "async",
            pipeline_parallel_size=2 if overlap == "pipeline-2" else 1,
        )
    )
    e.add_request(PREFIX, max_tokens=2)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    long = e.add_request(LONG, max_tokens=40)
    manager = e.scheduler.kv_cache_manager
    # A few tokens into its decode, so its prompt's stores are done (a store
    # waits for the compute before it, and a load behind it on the copy
    # stream would wait too), and a decode step of it in flight.
    while e.requests[long].num_output_tokens < 3 or not any(
        long in so.num_scheduled_tokens for so, _, _ in e.in_flight
    ):
        e.step()
    (held,) = manager.get_block_ids(long)
    e.abort(long)
    e.add_request(PREFIX + [7, 8], max_tokens=3)
    e.run()
    loaded = {
        d for x in e.copy_backend.launched if not x["is_store"] for _, d in x["pairs"]
    }
    assert set(held) & loaded, "the load reused the aborted request's blocks"
    assert load_races(e) == []
    assert e.runner.violations == []


def test_blocks_freed_out_of_step_order_wait_for_their_own_step():
    """With three pipeline stages, three steps are in flight. Two decoding
    requests aborted one after the other can be freed out of step order:
    the first one's last step is the later one. Each request's blocks must
    wait for its own step: giving back the first one's when the second
    one's earlier step is processed lets a load overwrite blocks a forward
    still in flight writes."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=16,
            num_cpu_blocks=64,
            pipeline_parallel_size=3,
        )
    )
    e.add_request(PREFIX, max_tokens=2)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    a = e.add_request(list(range(3000, 3000 + 5 * BS + 4)), max_tokens=60)
    b = e.add_request(list(range(4000, 4000 + 5 * BS + 4)), max_tokens=60)

    def last_step_in_flight(req_id: str) -> int:
        steps = [
            i
            for i, (so, _, _) in enumerate(e.in_flight)
            if req_id in so.num_scheduled_tokens
        ]
        return steps[-1] if steps else -1

    # Both decoding (their prompts stored), B's step in flight after A's.
    while not (
        min(e.requests[a].num_output_tokens, e.requests[b].num_output_tokens) >= 3
        and 0 <= last_step_in_flight(a) < last_step_in_flight(b)
    ):
        e.step()
    e.abort(b)
    e.abort(a)
    e.add_request(PREFIX + [7, 8], max_tokens=3)
    e.run()
    assert load_races(e) == []
    assert e.runner.violations == []


def test_a_reset_that_preempts_steps_in_flight_keeps_their_blocks_until_processed():
    """reset_prefix_cache(reset_running_requests=True) preempts requests
    whose step is in flight: their blocks come back only once that step is
    processed, so a CPU load admitted right after the reset writes other
    blocks, not the ones the forward in flight still reads and writes."""
    e = Engine(
        HarnessConfig(
            block_size=BS, num_gpu_blocks=16, num_cpu_blocks=64, async_scheduling=True
        )
    )
    s = e.scheduler
    e.add_request(PREFIX, max_tokens=2)
    e.run()
    assert s.reset_prefix_cache()  # only the CPU has PREFIX
    for i in range(1, 5):
        e.add_request(list(range(1000 * i, 1000 * i + 2 * BS + 3)), max_tokens=30)
    for _ in range(4):
        e.step()
    assert s.running and e.in_flight
    assert s.reset_prefix_cache(reset_running_requests=True)
    e.add_request(PREFIX + [7, 8], max_tokens=2)
    e.run()
    assert any(not x["is_store"] for x in e.copy_backend.launched), "a CPU hit"
    assert load_races(e) == []
    assert e.runner.violations == []
    assert len(e.stats.finished) == 6


def test_a_deferred_free_leaves_no_mamba_state_behind():
    """A Mamba align group keeps per-request state beside the blocks; a
    request whose free waits for its step in flight loses it too, as a
    request freed at once does."""
    from typing import get_args

    from vllm.config.cache import MambaCacheMode

    if "align" not in get_args(MambaCacheMode):
        pytest.skip("this release has no mamba_cache_mode 'align'")
    e = Engine(
        HarnessConfig(
            mamba="align",
            num_gpu_blocks=32,
            num_cpu_blocks=32,
            max_num_batched_tokens=128,
            async_scheduling=True,
        )
    )
    assert e.scheduler.defer_block_free
    for i in range(3):
        prompt = list(range(1000 * (i + 1), 1000 * (i + 1) + 40))
        e.add_request(prompt, max_tokens=20, stop_at=42)
    e.run()
    assert len(e.stats.finished) == 3
    for mgr in e.scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert not getattr(mgr, "_allocated_block_reqs", ())
        assert not getattr(mgr, "last_state_block_idx", {})
        assert not mgr.req_to_blocks


def test_a_null_block_among_the_deferred_frees_does_not_refuse_the_reset():
    """A sliding-window group's deferred frees can name the null block, whose
    ref_cnt nothing keeps (prefix hits past the window touch it). Counted as
    held on top of being always in use, it made the pool look one block
    short and refused a reset with nothing held (found in review)."""
    e = Engine(HarnessConfig(num_gpu_blocks=16, offload=False))
    pool = e.block_pool
    if "held_blocks" not in pool.reset_prefix_cache.__code__.co_varnames:
        pytest.skip("this tree's pool takes no deferred frees")
    pool.null_block.ref_cnt = 1  # as a window hit's touch leaves it
    assert pool.reset_prefix_cache([pool.null_block])
