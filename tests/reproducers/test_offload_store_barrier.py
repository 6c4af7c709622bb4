"""Reproducer for patch 0005: GPU->CPU stores are ordered after compute.

A store reads the live GPU KV cache from its own copy stream. On the base
nothing orders it after the compute stream's writes to those blocks, and
srcAccessOrder=ANY even lets the DMA read early: when the host runs ahead,
the store copies stale KV into the CPU cache (vllm#45704).

On a CPU the contract is checked where the copy reaches the CUDA driver:
through the real scheduler, worker and copy backend (harness.fake_cuda
stands in for streams, events and cuMemcpyBatchAsync), every store is
issued on a stream that waited for an event recorded on the compute stream
after the step's compute, with srcAccessOrder=STREAM; every load neither.
This holds whatever a release calls its barrier (0.24.0's own differs from
patch 0005's). On a GPU the race itself is run: the KV write is held
back with torch.cuda._sleep, and stores with and without the barrier are
counted stale or not.
"""

from __future__ import annotations

import time

import pytest
import torch

from harness.config import make_kv_cache_config, make_vllm_config
from harness.engine import Engine, HarnessConfig
from harness.offload_checks import lost_or_wrong_cpu_blocks, unordered_transfers

BS = 16
PROMPT = list(range(100, 200))


def test_store_waits_for_compute_load_does_not():
    cfg = HarnessConfig(block_size=BS, num_gpu_blocks=32, num_cpu_blocks=32)
    e = Engine(cfg)
    e.add_request(PROMPT, max_tokens=3)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    e.add_request(PROMPT + [7, 8], max_tokens=3)
    e.run()

    stores = [x for x in e.copy_backend.launched if x["is_store"]]
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert stores and loads
    assert unordered_transfers(e) == []
    assert e.runner.violations == []


def test_stores_copy_what_the_forward_wrote():
    """By content alone: every block stored holds what the forward wrote.
    B, admitted in the step A's prompt is computed, hits A's blocks as its
    prefix: they count as computed for B, and eager offload stores them in
    that very step, while the forward still writes them. The fake device
    (harness.fake_cuda) shows a store a write of its own step only if the
    store is ordered after it, so a store issued without a wait, with one
    on an event recorded before the forward, or reading out of stream order
    copies Stale KV."""
    cfg = HarnessConfig(block_size=BS, num_gpu_blocks=32, num_cpu_blocks=32)
    e = Engine(cfg)
    a = e.add_request(PROMPT, max_tokens=3)
    b = e.add_request(PROMPT[: 6 * BS] + [7, 8, 9], max_tokens=3)
    so = e.step()
    assert {a, b} <= set(so.num_scheduled_tokens), "both run in the first step"
    assert so.kv_connector_metadata.store_gpu_blocks, "stored in that step"
    e.run()
    assert lost_or_wrong_cpu_blocks(e, [a, b]) == []


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_no_store_races_the_forward_under_async_scheduling(lazy):
    """As vLLM runs on a GPU by default: step N+1 is launched before step
    N's output is processed, so the host never waits for a forward before
    the store of what it wrote is issued. The fake CUDA's happens-before
    checker reports every store read that nothing orders after the forward
    writing the same block, however the harness interleaved them (seed
    004): a store with no wait, one waiting for an event recorded before
    the forward or on another stream, or one reading out of stream order.
    Requests share a prefix and run side by side, with transfers late. Lazy
    offload stores blocks evicted long after their forward: a guard, not a
    reproducer."""
    cfg = HarnessConfig(
        block_size=BS,
        num_gpu_blocks=48,
        num_cpu_blocks=96,
        lazy=lazy,
        async_scheduling=True,
        transfer_delay=lambda is_store: 1,
    )
    e = Engine(cfg)
    ids = [
        e.add_request(PROMPT[: (3 + i) * BS] + [i] * (5 + 7 * i), max_tokens=4 + i)
        for i in range(4)
    ]
    e.run()
    # Lazy offload stores blocks as they are evicted: make it store them.
    e.add_request(list(range(3000, 3000 + 40 * BS)), max_tokens=2)
    e.run()
    stores = [x for x in e.copy_backend.launched if x["is_store"]]
    assert stores
    assert [str(r) for r in e.cuda.races if "store" in races_streams(r)] == []
    assert e.runner.violations == []
    # Blocks lost for another reason (a request's last blocks before 0.30.0)
    # are patch 0004's: only a wrong one is a store that raced.
    assert [p for p in lost_or_wrong_cpu_blocks(e, ids) if "wrong" in p] == []


def races_streams(race) -> tuple[str, str]:
    return (race.first.op.stream, race.second.op.stream)


# --- on a GPU: the race, both ways --------------------------------------------

ITERATIONS = 100
STORE_DEADLINE_S = 60
# About 10 ms of GPU time: far longer than it takes to launch the store.
SLEEP_CYCLES = 20_000_000
BLOCK_BYTES = 1 << 20


def make_gpu_worker(monkeypatch: pytest.MonkeyPatch):
    from vllm.v1.simple_kv_offload import worker as worker_module

    # The CPU platform plugin of the test environment says "no pinned
    # memory"; this machine has CUDA, and the DMA path wants pinned memory.
    monkeypatch.setattr(worker_module, "is_pin_memory_available", lambda: True)
    cfg = HarnessConfig(num_gpu_blocks=4, num_cpu_blocks=4)
    worker = worker_module.SimpleCPUOffloadWorker(
        make_vllm_config(cfg), make_kv_cache_config(cfg), 4 * BLOCK_BYTES
    )
    gpu = torch.zeros(4, BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    worker.register_kv_caches({"full.0": gpu})
    return worker, gpu, worker.cpu_kv_caches["full.0"]


def wait_for_store(worker, event_idx: int) -> None:
    """Poll the worker as the engine does until the store reports done.
    A store takes milliseconds; one not done in a minute never will be."""
    deadline = time.monotonic() + STORE_DEADLINE_S
    while True:
        assert worker._backend._thread.is_alive(), "the copy thread died"
        if time.monotonic() > deadline:
            pytest.fail(
                f"store event {event_idx} not reported done after "
                f"{STORE_DEADLINE_S} s: the copy or its event never completed"
            )
        worker.get_finished(set())
        meta = worker.build_connector_worker_meta()
        if meta is not None and event_idx in meta.completed_store_events:
            return


def count_stale_stores(worker, gpu, cpu, barrier: bool, first_event: int) -> int:
    from vllm.v1.simple_kv_offload.cuda_mem_ops import SrcAccessOrder, build_params
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    backend = worker._backend
    # The base's store params: the source read in any order.
    any_order = build_params(
        worker.gpu_kv_caches,
        worker.cpu_kv_caches,
        backend._store_stream,
        SrcAccessOrder.ANY,
    )
    stale = 0
    for i in range(ITERATIONS):
        event_idx, value = first_event + i, i % 250 + 1
        # The compute stream writes the block late, after the store launches.
        torch.cuda._sleep(SLEEP_CYCLES)
        gpu[1].fill_(value)
        if barrier:  # the worker's own store path
            worker.bind_connector_metadata(
                SimpleCPUOffloadMetadata(
                    store_event=event_idx, store_gpu_blocks=[1], store_cpu_blocks=[1]
                )
            )
            worker.wait_for_save()  # where releases from 0.30 store
            worker.get_finished(set())  # where earlier ones do
            worker.clear_connector_metadata()
        else:  # the base's store: no wait, source read in any order
            worker._pending_store_event_indices.add(event_idx)
            store_params = backend._store_params
            backend._store_params = any_order
            try:
                backend.launch_copy(
                    [1],
                    [1],
                    is_store=True,
                    event_idx=event_idx,
                    events_list=worker._store_events,
                )
            finally:
                backend._store_params = store_params
        wait_for_store(worker, event_idx)
        torch.cuda.synchronize()
        stale += bool((cpu[1] != value).any())
    return stale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_store_never_reads_a_delayed_kv_write_on_gpu(monkeypatch):
    pytest.importorskip("cuda.bindings")
    worker, gpu, cpu = make_gpu_worker(monkeypatch)
    try:
        without = count_stale_stores(worker, gpu, cpu, False, first_event=0)
        with_barrier = count_stale_stores(
            worker, gpu, cpu, True, first_event=ITERATIONS
        )
    finally:
        worker._backend.shutdown()
    print(
        f"\nstale stores over {ITERATIONS} iterations: without barrier "
        f"{without}, with barrier {with_barrier}"
    )
    assert without > 0, "the control never raced: the test proves nothing"
    assert with_barrier == 0
