"""Reproducer for an idle lazy engine that never stops storing (ledger row
offload-lazy-idle-store-loop).

From 0.30.0 SimpleCPUOffload answers `has_pending_push_work()` while a store
is in flight, in lazy mode as in eager, and EngineCore keeps an engine with
no request stepping until its stores complete. Lazy mode's scan stores free,
cached GPU blocks from the free queue's head in every step, one that
schedules nothing too: each store kept the idle engine stepping for another
scan. With a CPU tier smaller than what the GPU prefix cache holds, each
store evicted the CPU copies of blocks the next scan stored again, and the
engine never went idle: pause, sleep and the weight update's reset that wait
for it never came. With the fix a lazy scan starts no store once every
request the scheduler admitted has finished, and the engine goes idle when
the stores of its last busy step complete, holding nothing.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine
from harness.engine_core import held_gpu_blocks, offload_engine, step_as_engine_core


def lazy_engine(
    num_gpu_blocks: int, num_cpu_blocks: int, store_delay: int, prompts: int
) -> Engine:
    e = offload_engine(
        store_delay,
        lazy=True,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_num_batched_tokens=32,
    )
    for i in range(prompts):
        e.add_request(list(range(100 + 40 * i, 140 + 40 * i)), max_tokens=2)
    return e


def test_an_idle_lazy_engine_stops_storing():
    # 8 GPU blocks and 4 CPU blocks: three 40-token prompts leave more
    # cached blocks on the GPU than the CPU tier holds.
    e = lazy_engine(8, 4, store_delay=1, prompts=3)
    step_as_engine_core(e, max_steps=300)
    assert not e.scheduler.requests
    assert held_gpu_blocks(e) == 0, "the idle engine's store holds GPU blocks"
    assert e.scheduler.reset_prefix_cache()


@pytest.mark.parametrize("prompts", [1, 3])
@pytest.mark.parametrize("store_delay", [0, 1, 2])
@pytest.mark.parametrize(
    ("num_gpu_blocks", "num_cpu_blocks"),
    [(8, 2), (8, 4), (12, 4), (16, 6), (24, 4), (24, 10), (32, 64)],
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


@pytest.mark.parametrize("store_delay", [0, 1, 2])
@pytest.mark.parametrize(("num_gpu_blocks", "num_cpu_blocks"), [(8, 4), (24, 10)])
def test_a_lazy_scan_is_left_out_only_in_a_step_taken_for_stores(
    num_gpu_blocks: int, num_cpu_blocks: int, store_delay: int
):
    """Every step scans as the release's does, but one in which no request
    the scheduler admitted is left unfinished and a store is in flight: a
    step with a request running or loading, and one with nothing in flight
    (the step that reports the last finished request, say), still scan."""
    from vllm.v1.request import RequestStatus

    e = lazy_engine(num_gpu_blocks, num_cpu_blocks, store_delay, prompts=3)
    manager = e.offload
    prepare, scan = manager.prepare_store_specs, manager._prepare_lazy_store_specs
    steps: list[tuple[bool, bool]] = []  # (the release would scan, scanned)

    def counted_scan():
        steps[-1] = (steps[-1][0], True)
        return scan()

    def recorded_prepare(scheduler_output):
        admitted = any(
            r.status != RequestStatus.WAITING for r in e.scheduler.requests.values()
        )
        steps.append((admitted or not manager.has_pending_stores(), False))
        return prepare(scheduler_output)

    manager.prepare_store_specs = recorded_prepare
    manager._prepare_lazy_store_specs = counted_scan
    step_as_engine_core(e, max_steps=300)
    assert steps and all(scanned == want for want, scanned in steps), steps
    assert any(not want for want, _ in steps) == (store_delay > 0)
    assert manager.cpu_block_pool.cached_block_hash_to_block, "nothing stored"
