"""A prefix hit reported in full, under decode context parallelism or ending
inside a block (ledger row dcp-full-report-events, vllm#50118).

A request with `kv_cache_report_mode="full"` has the scheduler publish a
BlockStored event for every block its prefix hit reuses, so that a KV-aware
router learns what this engine holds (0.26.0 on). The events are built from
the request's block hashes, resolved at the block size the caller passes:
the group's spec size. Under DCP the scheduler's blocks hold that size times
the DCP world size, and the hashes are computed at that scaled size, so the
resolution asserts `block_size % hash_block_size == 0` and EngineCore dies
on the first such hit (0.26.0-0.33.0; no fix upstream). With the patch the
events are those the blocks were first stored with: the same hashes, the
same tokens, the scheduler's block size.

A hybrid with a Mamba "align" group hashed finer than its attention blocks
(prefix_match_unit) can hit up to a point inside a block: that block was
never stored whole and the request has no hash for it at the block's size,
so a full report of such a hit raised IndexError on the bare release, with
or without DCP. With the patch a full report names whole blocks only.
"""

from __future__ import annotations

import inspect

import pytest
from vllm.v1.core import kv_cache_coordinator, kv_cache_manager

from harness.engine import Engine, HarnessConfig
from harness.prefix_match_unit import PMU_PROMPT, pmu_engine

PROMPT = [100 + t for t in range(96)]


def report_mode_exists() -> bool:
    """Whether this release publishes a full report of a prefix hit."""
    return any(
        "kv_cache_report_mode" in inspect.getsource(module)
        for module in (kv_cache_manager, kv_cache_coordinator)
    )


class EventRecorder:
    """Stands in for the scheduler's KV event publisher (ZMQ in a server):
    keeps each batch update_from_output publishes."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def record_events(e: Engine) -> EventRecorder:
    """Turn the engine's KV events on and record what its scheduler
    publishes."""
    manager = e.scheduler.kv_cache_manager
    manager.enable_kv_cache_events = True
    manager.block_pool.enable_kv_cache_events = True
    recorder = EventRecorder()
    e.scheduler.kv_event_publisher = recorder
    return recorder


def stored_blocks(recorder: EventRecorder) -> list[tuple]:
    """The blocks the BlockStored events published since the last call:
    (group, hash, its tokens, the event's block size) per block."""
    blocks = []
    for event in recorder.events:
        if type(event).__name__ != "BlockStored":
            continue
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * size : (i + 1) * size])
            blocks.append((event.group_idx, block_hash, tokens, size))
    recorder.events.clear()
    return blocks


@pytest.mark.parametrize("dcp", [1, 2])
def test_a_prefix_hit_reported_in_full_publishes_the_blocks_as_stored(dcp):
    if not report_mode_exists():
        pytest.skip("this release has no kv_cache_report_mode (before 0.26.0)")
    e = Engine(
        HarnessConfig(
            offload=False, decode_context_parallel_size=dcp, num_gpu_blocks=64
        )
    )
    recorder = record_events(e)
    e.add_request(PROMPT, max_tokens=2)
    e.run()
    first = stored_blocks(recorder)
    num_hit_blocks = len(PROMPT) // (16 * dcp)
    assert [size for *_, size in first] == [16 * dcp] * num_hit_blocks

    reader = e.add_request(PROMPT + [1, 2, 3], max_tokens=2)
    e.scheduler.requests[reader].kv_cache_report_mode = "full"
    e.run()
    # Its hit is the whole prompt: those blocks, each as the first request
    # stored it (the reader stores none of its own: its full blocks are
    # the prompt's).
    assert stored_blocks(recorder) == first


@pytest.mark.parametrize("dcp", [1, 2])
def test_a_hit_ending_inside_a_block_is_reported_in_whole_blocks(dcp):
    if not report_mode_exists():
        pytest.skip("this release has no kv_cache_report_mode (before 0.26.0)")
    # Full attention 16 + Mamba "align" 16 hashed every 8 tokens; the
    # prompt's last hash boundary (40) lies inside attention block #2.
    e = pmu_engine(offload=False, decode_context_parallel_size=dcp)
    recorder = record_events(e)
    e.add_request(PMU_PROMPT, max_tokens=2)
    e.run()
    first = stored_blocks(recorder)

    # One token more: its hit is the prompt's, and it fills no new block.
    reader = e.add_request(PMU_PROMPT + [1], max_tokens=2)
    e.scheduler.requests[reader].kv_cache_report_mode = "full"
    e.run()
    assert reader in e.stats.finished
    reported = stored_blocks(recorder)
    assert reported
    # Whole blocks, each with the tokens of its size. An attention block is
    # reported as the first request stored it; a Mamba "align" block is not
    # (it holds the state at a point the hit chose, as on the bare release).
    assert all(len(tokens) == size for _, _, tokens, size in reported)
    attention = [block for block in reported if block[0] == 0]
    assert all(block in first for block in attention)
    # Every whole attention block of the hit (40 tokens) is reported, one
    # at DCP 2: a report that skips a hit of a single block is a gap too.
    size = 16 * dcp
    assert len([block for block in attention if block[3] == size]) == 40 // size
