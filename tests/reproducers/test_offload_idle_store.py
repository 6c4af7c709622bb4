"""Reproducer for an idle engine's last store (ledger row
offload-idle-store-holds-blocks).

EngineCore steps only while `Scheduler.has_requests()`. A SimpleCPUOffload
store launched in a request's last steps completes in a later step, and the
GPU blocks it copies from stay held until then. Where nothing keeps the
engine stepping for it, an engine that has answered its last request idles
with that store in flight: its blocks stay held until new traffic comes, and
the prefix-cache reset an RL framework runs after draining (a weight update:
`reset_running_requests=True`) raises "Failed to reset KV cache". With the
fix the connector answers `has_pending_push_work()` (the hook the scheduler
reads from 0.24.0; 0.30.0's connector answers it) while a store is queued or
in flight, and the engine steps until it completes.
Lazy mode, whose scan starts stores in empty steps too, is kept stepping
only with the rule of 0024: tests/reproducers/test_offload_lazy_idle.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from harness.engine import Engine
from harness.engine_core import (
    engine_core_proc,
    held_gpu_blocks,
    step_as_engine_core,
)
from harness.engine_core import offload_engine as engine


def drained(store_delay: int, **overrides) -> Engine:
    """One block of prefill per step, so the prompt's second block is
    computed in the step that finishes the request: its store is launched
    then and completes `store_delay` steps on."""
    overrides.setdefault("max_num_batched_tokens", 16)
    e = engine(store_delay, **overrides)
    e.add_request(list(range(100, 132)), max_tokens=1)
    step_as_engine_core(e)
    return e


def test_an_idle_engine_holds_no_blocks_for_its_last_store():
    e = drained(store_delay=2)
    assert held_gpu_blocks(e) == 0, "the idle engine's store holds GPU blocks"
    assert e.scheduler.reset_prefix_cache()


def test_a_weight_update_after_the_engine_drained_resets_the_caches():
    e = drained(store_delay=2)
    # An RL framework's reset after a weight update: it raises "Failed to
    # reset KV cache" where a block is still held.
    assert e.scheduler.reset_prefix_cache(
        reset_running_requests=True, reset_connector=True
    )
    assert held_gpu_blocks(e) == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("store_delay", [0, 1, 2])
@pytest.mark.parametrize("max_tokens", [1, 2, 17])
def test_no_store_outlives_the_engines_last_step(
    max_tokens: int, store_delay: int, async_scheduling: bool
):
    """Where the release idles with nothing held, the series must too: its
    store of a finished request's last blocks (0004) is queued at the
    finish and launched in the next step, which an idle engine never takes
    unless the connector asks for it."""
    e = engine(store_delay, async_scheduling=async_scheduling)
    e.add_request(list(range(100, 148)), max_tokens=max_tokens)
    step_as_engine_core(e)
    assert held_gpu_blocks(e) == 0, "the idle engine's store holds GPU blocks"
    assert not e.offload.has_pending_stores()
    assert e.scheduler.reset_prefix_cache()


def test_an_engine_stepping_for_a_store_yields_between_its_empty_steps(
    monkeypatch: pytest.MonkeyPatch,
):
    """Once the last request is done, EngineCore steps only for the store
    still in flight: steps with no forward, each polling the store. Its
    busy loop must yield the GIL after each one that leaves the store
    pending (the millisecond's sleep it takes while requests wait for
    remote KV) rather than spin a core and starve the threads beside it.
    EngineCoreProc's own step, around the harness's engine."""
    e = engine(store_delay=2, max_num_batched_tokens=16)
    e.add_request(list(range(100, 132)), max_tokens=1)
    proc = engine_core_proc(e)
    sleeps: list[float] = []
    sleep = time.sleep

    def recorded_sleep(seconds: float) -> None:
        # The engine loop's own sleeps only: another thread's still sleep.
        if threading.current_thread() is threading.main_thread():
            sleeps.append(seconds)
        else:
            sleep(seconds)

    monkeypatch.setattr(time, "sleep", recorded_sleep)
    polls = 0
    for _ in range(100):
        if not (e.scheduler.has_requests() or e.in_flight):
            break
        before = len(sleeps)
        executed = proc._process_engine_step()
        if not executed and e.scheduler.has_requests():
            # The store is still in flight: the loop steps again at once.
            polls += 1
            assert sleeps[before:] == [0.001], "an empty step did not yield"
    assert polls, "the engine never stepped for its store alone"
    assert held_gpu_blocks(e) == 0


def test_a_multi_connector_answers_for_its_offload_connector():
    """SimpleCPUOffload behind a MultiConnector (with a P/D connector, say)
    keeps the engine stepping too: MultiConnector asks each connector. The
    other connector here, vLLM's example connector, keeps no transfer going
    after its requests and answers through the base class's default (False).
    Built around the harness's own connector, without MultiConnector's
    __init__, which would build a second one from the config."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
    )

    e = engine(store_delay=2, max_num_batched_tokens=16)
    multi = MultiConnector.__new__(MultiConnector)
    example = ExampleConnector.__new__(ExampleConnector)
    multi._connectors = [example, e.scheduler.connector]
    e.add_request(list(range(100, 132)), max_tokens=1)
    seen = False
    for _ in range(100):
        if not e.busy():
            break
        e.step()
        seen |= multi.has_pending_push_work()
        assert multi.has_pending_push_work() == e.offload.has_pending_stores()
    assert seen, "no store was pending while the request ran"
    assert not multi.has_pending_push_work()
    assert not example.has_pending_push_work()
