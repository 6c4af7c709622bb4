"""Reproducers for an idle lazy engine that never stops storing (ledger row
offload-lazy-idle-store-loop, 0.30.0-0.33.0) and for one that idles with
its stores' blocks held (offload-lazy-idle-store-holds-blocks, 0.19.0-0.29.0).

From 0.30.0 SimpleCPUOffload answers `has_pending_push_work()` while a store
is in flight, in lazy mode as in eager, and EngineCore keeps an engine with
nothing to run (no request, a pause that keeps its requests, a streaming
session waiting for input) stepping until its stores complete. Lazy mode's
scan stores free, cached GPU blocks from the free queue's head in every
step, one that schedules nothing too: each store kept the engine stepping
for another scan. With a CPU tier smaller than what the GPU prefix cache
holds, each store evicted the CPU copies of blocks the next scan stored
again, and the engine never went idle: pause, sleep and the weight update's
reset that wait for it never came. With the fix a lazy scan starts no store
in a step that schedules no token and has no load while a store is in
flight, and the engine goes idle when the stores of its last busy step
complete, holding nothing.

Before 0.30.0 nothing keeps a lazy engine stepping (the fork's keep-alive,
0023, answers in eager mode only): it goes idle with the stores of its last
steps in flight and their GPU blocks held until new traffic, so the reset
after a weight update fails. 0024 keeps it stepping there, with the same
rule for its scans.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from harness.engine import Engine, HarnessConfig
from harness.engine_core import held_gpu_blocks, lazy_engine, step_as_engine_core


def test_an_idle_lazy_engine_stops_storing():
    # 8 GPU blocks and 4 CPU blocks: three 40-token prompts leave more
    # cached blocks on the GPU than the CPU tier holds.
    e = lazy_engine(8, 4, store_delay=1, prompts=3)
    step_as_engine_core(e, max_steps=300)
    assert not e.scheduler.requests
    assert held_gpu_blocks(e) == 0, "the idle engine's store holds GPU blocks"
    assert e.scheduler.reset_prefix_cache()


@pytest.mark.parametrize("prompts", [1, 3, 4])
@pytest.mark.parametrize("store_delay", [0, 1, 2])
@pytest.mark.parametrize(
    ("num_gpu_blocks", "num_cpu_blocks"),
    [(8, 2), (8, 4), (12, 4), (16, 4), (24, 10), (32, 64)],
)
def test_a_lazy_engine_goes_idle_holding_nothing(
    num_gpu_blocks: int, num_cpu_blocks: int, store_delay: int, prompts: int
):
    """Kept stepping for the stores of its last busy step, and for no
    other, the engine goes idle with nothing held and nothing in flight."""
    e = lazy_engine(num_gpu_blocks, num_cpu_blocks, store_delay, prompts)
    step_as_engine_core(e, max_steps=300)
    assert not e.scheduler.requests
    assert not e.offload.has_pending_stores()
    assert held_gpu_blocks(e) == 0


def missed_by_the_next_scan(e: Engine) -> list[int]:
    """Free, hashed GPU blocks without a CPU copy that lie before the lazy
    scan's cursor in the free queue: the next scan starts after the cursor
    and passes them. A cursor on a block taken out of the queue is stale,
    and the scan then starts from the head."""
    manager = e.offload
    cursor = manager._cursor
    if cursor is None or cursor.ref_cnt > 0:
        return []
    cpu_hashes = manager.cpu_block_pool.cached_block_hash_to_block
    missed = []
    node = e.block_pool.free_block_queue.fake_free_list_head.next_free_block
    while node is not None and node is not cursor:
        bhash = node.block_hash
        if bhash is not None and cpu_hashes.get_one_block(bhash) is None:
            missed.append(node.block_id)
        node = node.next_free_block
    return missed


@pytest.mark.parametrize("prompts", [3, 4])
@pytest.mark.parametrize("store_delay", [1, 2])
@pytest.mark.parametrize("num_gpu_blocks", [24, 32])
def test_the_next_scan_reaches_every_block_the_cpu_lacks(
    num_gpu_blocks: int, store_delay: int, prompts: int
):
    """With a CPU tier larger than the GPU pool nothing is evicted from it,
    so a block the scans visited keeps its CPU copy: an engine gone idle
    leaves its cursor where the next scan reaches every block still
    missing. A step that skips the scan drops a cursor on a block a store
    holds, as the scan does; left there, the cursor sat at the free queue's
    tail once that store completed."""
    e = lazy_engine(num_gpu_blocks, 64, store_delay, prompts)
    step_as_engine_core(e, max_steps=300)
    assert not missed_by_the_next_scan(e)


def test_a_skipped_scan_keeps_a_cursor_on_a_free_block():
    """Only a cursor a store holds is dropped: one on a block in the free
    queue stays where the next scan goes on from, as the release's scan in
    that step would have gone on from it."""
    e = lazy_engine(24, 10, store_delay=2, prompts=3)
    for _ in range(300):
        if not e.scheduler.requests and e.offload.has_pending_stores():
            break
        assert e.scheduler.has_requests(), "no step was taken for a store alone"
        e.step()
    free = e.block_pool.free_block_queue.fake_free_list_head.next_free_block
    e.offload._cursor = free
    e.step()
    assert e.offload._cursor is free


@pytest.mark.parametrize("store_delay", [1, 2])
@pytest.mark.parametrize(("num_gpu_blocks", "num_cpu_blocks"), [(12, 4), (16, 4)])
def test_a_streaming_session_waiting_for_input_lets_the_engine_idle(
    num_gpu_blocks: int, num_cpu_blocks: int, store_delay: int
):
    """A session waiting for its next input is not counted as unfinished
    by the scheduler: the engine steps only for the connector's stores."""
    e = lazy_engine(num_gpu_blocks, num_cpu_blocks, store_delay, 4, streaming=True)
    step_as_engine_core(e, max_steps=300)
    assert list(e.scheduler.requests) == ["r3"], "the session waits for input"
    assert not e.offload.has_pending_stores()


@pytest.mark.parametrize("store_delay", [1, 2])
@pytest.mark.parametrize(("num_gpu_blocks", "num_cpu_blocks"), [(8, 4), (12, 4)])
def test_a_pause_that_keeps_its_requests_completes(
    num_gpu_blocks: int, num_cpu_blocks: int, store_delay: int
):
    """pause_generation(mode="keep") waits for an engine with no work: the
    paused scheduler schedules nothing and reports no unfinished request,
    so it steps only for the connector's stores."""
    from vllm.v1.core.sched.interface import PauseState

    e = lazy_engine(num_gpu_blocks, num_cpu_blocks, store_delay, 3)
    e.add_request(list(range(500, 508)), max_tokens=1000, req_id="long")
    for _ in range(12):
        e.step()
    e.scheduler.set_pause_state(PauseState.PAUSED_ALL)
    step_as_engine_core(e, max_steps=300)
    assert "long" in e.scheduler.requests, "the paused request is kept"
    assert not e.offload.has_pending_stores()


class StepRecord(NamedTuple):
    scheduled: bool  # the step scheduled a token
    loading: bool  # a load was started or in flight
    storing: bool  # a store was queued or in flight
    scanned: bool


def record_scans(e: Engine) -> list[StepRecord]:
    """What each step's store planning saw, and whether it scanned."""
    manager = e.offload
    prepare, scan = manager.prepare_store_specs, manager._prepare_lazy_store_specs
    steps: list[StepRecord] = []

    def counted_scan():
        steps[-1] = steps[-1]._replace(scanned=True)
        return scan()

    def recorded_prepare(scheduler_output):
        steps.append(
            StepRecord(
                scheduler_output.total_num_scheduled_tokens > 0,
                bool(manager._reqs_to_load),
                manager.has_pending_stores(),
                False,
            )
        )
        return prepare(scheduler_output)

    manager.prepare_store_specs = recorded_prepare
    manager._prepare_lazy_store_specs = counted_scan
    return steps


def left_out_wrongly(steps: list[StepRecord]) -> list[tuple[int, StepRecord]]:
    """Steps whose scan was left out, or not, against the rule: only a step
    that schedules no token and has no load while a store is in flight
    starts no lazy store."""
    return [
        (n, s)
        for n, s in enumerate(steps)
        if s.scanned != (s.scheduled or s.loading or not s.storing)
    ]


@pytest.mark.parametrize("store_delay", [0, 1, 2])
@pytest.mark.parametrize(("num_gpu_blocks", "num_cpu_blocks"), [(8, 4), (24, 10)])
def test_a_lazy_scan_is_left_out_only_in_a_step_taken_for_stores(
    num_gpu_blocks: int, num_cpu_blocks: int, store_delay: int
):
    """A step that runs a request, and one with nothing in flight (the
    step that reports the last finished request, say), scan as the
    release's do; with stores completing in a later step the rule acts."""
    e = lazy_engine(num_gpu_blocks, num_cpu_blocks, store_delay, prompts=3)
    steps = record_scans(e)
    step_as_engine_core(e, max_steps=300)
    assert steps and not left_out_wrongly(steps)
    if store_delay > 0:
        assert any(not s.scanned for s in steps), "the rule never acted"
    assert e.offload.cpu_block_pool.cached_block_hash_to_block, "nothing stored"


def test_a_step_that_waits_for_a_load_scans():
    """A request sent again after the GPU evicted its prompt loads it from
    the CPU tier (two steps a load): the steps that admit and wait for the
    load schedule no token, and scan as the release's do although a store
    is in flight."""
    e = Engine(
        HarnessConfig(
            lazy=True,
            num_gpu_blocks=8,
            num_cpu_blocks=16,
            max_num_batched_tokens=32,
            transfer_delay=lambda is_store: 2,
        )
    )
    steps = record_scans(e)
    for i in range(6):
        e.add_request(list(range(100 + 40 * i, 140 + 40 * i)), max_tokens=2)
    step_as_engine_core(e, max_steps=300)
    e.add_request(list(range(100, 140)), max_tokens=2)
    step_as_engine_core(e, max_steps=300)
    assert not left_out_wrongly(steps)
    assert any(s.loading and s.storing and not s.scheduled for s in steps), (
        "no step waited for a load with a store in flight"
    )
