"""Reproducer for the CPU tier's reset (ledger row offload-reset-unsupported).

After a weight update the KV cached on the CPU was computed with the old
weights. `reset_prefix_cache(reset_connector=True)` (an RL framework's
reset, `/reset_prefix_cache?reset_external=true`, and on 0.23.0 every pause
that clears caches) asks the connector to drop it. On 0.19.0-0.23.0
SimpleCPUOffloadConnector.reset_cache raises NotImplementedError, after the
GPU prefix cache was already cleared, and the CPU tier goes on serving the
old KV. With the fix the reset clears the tier, refuses (False, nothing
lost) while a transfer is in flight, and releases the pin of a request that
waits for blocks.
"""

from __future__ import annotations

from harness.engine import Engine, HarnessConfig
from harness.logs import warnings_of
from harness.offload_checks import (
    assert_cpu_pool_free,
    cpu_block_of,
    loaded_blocks,
    new_request,
)

PROMPT = list(range(100, 148))  # three full blocks of 16
EXTENSION = list(range(900, 917))


def engine(delay_stores: int = 0, delay_loads: int = 0) -> Engine:
    # A delay keeps a transfer in flight for that many steps after its launch.
    return Engine(
        HarnessConfig(
            num_gpu_blocks=32,
            num_cpu_blocks=32,
            transfer_delay=lambda is_store: delay_stores if is_store else delay_loads,
        )
    )


def test_a_reset_clears_the_cpu_tier():
    e = engine()
    e.add_request(PROMPT, max_tokens=3)
    e.run()
    a = new_request(e, PROMPT)
    assert cpu_block_of(e, a, 2) is not None, "the prompt is on the CPU"

    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    assert cpu_block_of(e, a, 0) is None, "the CPU tier kept a hash"
    e.add_request(PROMPT + EXTENSION, max_tokens=2)
    assert not loaded_blocks(e), "the CPU tier served KV from before the reset"
    assert_cpu_pool_free(e)
    assert e.runner.violations == []


def step_until(e: Engine, launched) -> None:
    for _ in range(40):
        e.step()
        if launched(e.offload):
            return
    raise AssertionError("no transfer was launched")


def test_a_reset_refuses_while_a_store_is_in_flight_and_loses_nothing():
    e = engine(delay_stores=2)
    e.add_request(PROMPT, max_tokens=8)
    step_until(e, lambda off: off._store_event_to_blocks)
    free = e.offload.cpu_block_pool.get_num_free_blocks()

    with warnings_of("vllm.v1.simple_kv_offload.manager") as warnings:
        assert e.scheduler.reset_connector_cache() is False
    assert e.offload.cpu_block_pool.get_num_free_blocks() == free
    # The refusal says what holds the CPU blocks; upstream's reset (0.24.0
    # on) abandons the store instead, and logs no count.
    abandons = hasattr(e.offload, "_abandoned_store_event_to_blocks")
    counted = [w for w in warnings if "0 loads and 1 stores are in flight" in w]
    assert abandons or len(counted) == 1, warnings

    e.run()
    a = new_request(e, PROMPT)
    assert cpu_block_of(e, a, 2) is not None, "the refused reset lost the store"
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    e.add_request(PROMPT + EXTENSION, max_tokens=2)
    assert not loaded_blocks(e), "the retried reset left the prompt on the CPU"
    assert_cpu_pool_free(e)
    assert e.runner.violations == []


def test_a_reset_refuses_while_a_load_is_in_flight_and_the_load_completes():
    e = engine(delay_loads=2)
    e.add_request(PROMPT, max_tokens=3)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    b = e.add_request(PROMPT + EXTENSION, max_tokens=2)
    step_until(e, lambda off: off._reqs_to_load)

    assert e.scheduler.reset_connector_cache() is False
    e.run()
    assert b in e.stats.finished
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    assert_cpu_pool_free(e)
    assert e.runner.violations == []


def test_a_reset_releases_the_pin_of_a_request_waiting_for_blocks():
    e = engine()
    e.add_request(PROMPT, max_tokens=3)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    # The scheduler's lookup for a request that then gets no blocks: its
    # CPU hit stays pinned until it is considered again.
    b = new_request(e, PROMPT + EXTENSION, req_id="b")
    assert e.offload.get_num_new_matched_tokens(b, 0) == (len(PROMPT), True)

    assert e.scheduler.reset_connector_cache()
    assert_cpu_pool_free(e)
    # Considered again, it finds no hit and computes its prompt.
    assert e.offload.get_num_new_matched_tokens(b, 0) == (0, False)


def test_a_refusal_counts_a_finished_requests_store():
    """The store of a finished request's last block (the series' store on
    finish) is queued until the next step launches it; a reset in between
    refuses, and its warning counts that store with the others."""
    e = engine(delay_stores=2)
    e.add_request(PROMPT, max_tokens=1)
    step_until(e, lambda off: off._finish_flushes)
    off = e.offload
    stores = len(off._store_event_to_blocks) + len(off._finish_flushes)
    with warnings_of("vllm.v1.simple_kv_offload.manager") as warnings:
        assert e.scheduler.reset_connector_cache() is False
    assert any(
        f"{len(off._reqs_to_load)} loads and {stores} stores are in flight" in w
        for w in warnings
    ), warnings
    e.run()
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    assert_cpu_pool_free(e)
