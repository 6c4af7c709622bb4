"""Reproducer for patch 0004: eager offload stores a finishing request's
last block.

Eager stores cover blocks confirmed before the step (connector metadata is
built before num_computed_tokens advances), so the block a request
completes in the step it finishes in was never stored on the base
(vllm#41704). Seed 002's scenario through the real scheduler: a two-block
prompt prefilled in two chunks finishes with its second chunk; a later
prompt extending it finds one block on the CPU on the base, two with the
series.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_pool_ok
from harness.offload_checks import cpu_block_of, lost_or_wrong_cpu_blocks

BS = 16
PROMPT = list(range(100, 100 + 2 * BS))
EXTENDED = PROMPT + list(range(900, 900 + BS + 1))


def engine(store_delay: int = 0, blocks_per_step: int = 1) -> Engine:
    # One block of prefill per step by default: the prompt's second block
    # is computed in the step that samples its only output token.
    cfg = HarnessConfig(
        block_size=BS,
        num_gpu_blocks=32,
        num_cpu_blocks=32,
        max_num_batched_tokens=blocks_per_step * BS,
        transfer_delay=lambda is_store: store_delay if is_store else 0,
    )
    return Engine(cfg)


def assert_all_released(e: Engine) -> None:
    assert_pool_ok(e.block_pool, all_done=True, label="GPU pool")
    assert_pool_ok(
        e.offload.cpu_block_pool,
        all_done=True,
        label="CPU pool",
        hashed_means_cached=False,
    )


def test_extended_prompt_hits_both_blocks():
    e = engine()
    a = e.add_request(PROMPT, max_tokens=1)
    e.step()
    e.step()
    assert e.stats.finished == {a}, "finished with its second block"
    e.run()

    # Only the CPU has the prompt now; the extension loads what it holds.
    assert e.block_pool.reset_prefix_cache()
    b = e.add_request(EXTENDED, max_tokens=1)
    e.run()
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    cpu_hit_tokens = sum(len(x["pairs"]) for x in loads) * BS
    assert cpu_hit_tokens == 2 * BS, "the base stores one block of two"
    assert lost_or_wrong_cpu_blocks(e, [a]) == []
    assert e.stats.finished == {a, b}
    assert e.runner.violations == []
    assert_all_released(e)


def test_flush_keeps_state_until_store_completes_and_returns_gpu_refs():
    e = engine(store_delay=3)
    a = e.add_request(PROMPT, max_tokens=1)
    e.step()
    e.step()
    assert e.stats.finished == {a}
    # Finished, its blocks freed by the scheduler, but the final block is
    # queued for store: the request's store state stays, and the block
    # keeps the ref the flush took.
    state = e.offload._reqs_to_store[a]
    assert state.finished
    (gpu_id,) = e.offload._finish_flushes[a].gpu_block_ids
    assert gpu_id == e.runner.tables[a][0][1]
    assert e.block_pool.blocks[gpu_id].ref_cnt == 1

    e.step()  # the flush joins this step's store event
    assert state.store_events and a in e.offload._reqs_to_store
    e.run()
    assert a not in e.offload._reqs_to_store
    assert e.offload._finish_flushes == {}
    req = e.requests[a]
    assert cpu_block_of(e, req, 0) and cpu_block_of(e, req, 1)
    assert lost_or_wrong_cpu_blocks(e, [a]) == []
    assert_all_released(e)


def test_aborted_request_flushes_confirmed_blocks_only():
    e = engine()
    a = e.add_request(PROMPT + list(range(700, 720)), max_tokens=4)
    e.step()
    e.step()
    e.abort(a)  # two blocks computed, the first stored, none beyond
    e.run()
    req = e.requests[a]
    assert req.num_computed_tokens == 2 * BS
    assert lost_or_wrong_cpu_blocks(e, [a]) == []
    assert_all_released(e)


def test_a_block_being_flushed_is_not_stored_again():
    """A flush joins the step's store event. A request that shares the
    flushed block (a GPU prefix hit) must not store it again in the same
    event: the CPU would hold the block twice, one copy unreachable."""
    e = engine()
    a = e.add_request(PROMPT, max_tokens=1)
    e.step()
    e.step()
    assert e.stats.finished == {a}, "finished with its second block"
    # B hits both blocks on the GPU in the step the flush is launched.
    e.add_request(EXTENDED, max_tokens=1)
    e.run()
    stores = [x for x in e.copy_backend.launched if x["is_store"]]
    stored = [gpu for x in stores for gpu, _ in x["pairs"]]
    assert len(stored) == len(set(stored)), f"GPU blocks stored: {stored}"
    assert lost_or_wrong_cpu_blocks(e, [a]) == []
    assert_all_released(e)


def test_a_flush_stores_only_what_the_free_cpu_blocks_hold():
    """A request that finishes in the step that computes its whole prompt
    leaves every block unstored: its flush asks for more CPU blocks than
    are free (2 of a 3-block pool, one being the null block). It stores
    what fits, takes no CPU block the pool does not have, and gives every
    GPU ref back."""
    cfg = HarnessConfig(
        block_size=BS,
        num_gpu_blocks=32,
        num_cpu_blocks=3,
        max_num_batched_tokens=8 * BS,
    )
    e = Engine(cfg)
    a = e.add_request(list(range(100, 100 + 4 * BS)), max_tokens=1)
    e.step()
    assert e.stats.finished == {a}, "finished in the step of its whole prompt"
    e.run()
    stored = [p for x in e.copy_backend.launched if x["is_store"] for p in x["pairs"]]
    assert 1 <= len(stored) <= 2
    assert [p for p in lost_or_wrong_cpu_blocks(e, [a]) if "wrong" in p] == []
    assert_all_released(e)


def test_a_flush_with_no_store_in_flight_leaves_no_request_state():
    """A request that finishes in the step that computes its whole prompt
    never had a store in flight: the flush is its only store. Once that
    store completes, the connector keeps nothing of the request (the flush
    must name the request in its store event, or its state is never
    cleaned up)."""
    e = engine(store_delay=1, blocks_per_step=2)
    a = e.add_request(PROMPT, max_tokens=1)
    e.step()  # both blocks computed, the request finishes
    assert e.stats.finished == {a}
    state = e.offload._reqs_to_store[a]
    assert state.finished and not state.store_events
    e.step()  # the flush joins this step's store event
    assert state.store_events, "the flush's event is the request's"
    e.run()
    assert a not in e.offload._reqs_to_store
    assert e.offload._finish_flushes == {}
    assert not getattr(e.offload, "_store_event_to_reqs", {})
    assert lost_or_wrong_cpu_blocks(e, [a]) == []
    assert_all_released(e)


def test_a_flush_goes_on_past_a_block_another_flush_stores():
    """Two requests that share a prefix block finish in the same step, the
    shared block not yet on the CPU: whichever flush or store takes the
    shared block, each request's own block after it reaches the CPU too."""
    e = engine(blocks_per_step=4)
    a = e.add_request(PROMPT, max_tokens=1)
    # B hits A's first block, cached when A was allocated in this schedule.
    b = e.add_request(PROMPT[:BS] + list(range(500, 500 + BS)), max_tokens=1)
    e.step()
    assert e.stats.finished == {a, b}, "both finish in the step of their prompt"
    assert e.runner.tables[b][0][0] == e.runner.tables[a][0][0], "B hits A's"
    e.run()
    assert lost_or_wrong_cpu_blocks(e, [a, b]) == []
    assert_all_released(e)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_flush_goes_on_past_the_null_blocks_of_a_window(async_scheduling: bool):
    """A hybrid request whose whole prompt, longer than the window, is
    computed in the step it finishes in has stored nothing. Before it hands
    the block table to the connector, the scheduler frees the window
    group's blocks the window has left (remove_skipped_blocks in
    _connector_finished): the table the flush reads starts with null
    blocks, which the flush must skip to store the window's last blocks
    after them (the per-step scan never saw them). Stopping at the
    first null block stores none of the window group, and a later prompt
    extending this one finds no CPU hit: a hybrid hit needs the window's
    blocks as well as every full-attention block."""
    window_blocks = 4
    cfg = HarnessConfig(
        block_size=BS,
        hybrid=True,
        sliding_window=window_blocks * BS,
        num_gpu_blocks=64,
        num_cpu_blocks=64,
        max_num_batched_tokens=8 * BS,
        async_scheduling=async_scheduling,
    )
    e = Engine(cfg)
    prompt = list(range(100, 100 + 2 * window_blocks * BS))
    a = e.add_request(prompt, max_tokens=1)
    chunks: list[int] = []
    while a not in e.stats.finished:
        so = e.step()
        if so is not None and a in so.num_scheduled_tokens:
            chunks.append(so.num_scheduled_tokens[a])
    assert chunks == [len(prompt)], "finished in the step of its whole prompt"
    e.run()
    assert lost_or_wrong_cpu_blocks(e, [a]) == []

    # Only the CPU has the prompt now: the extension hits all of it there
    # and computes only its own tokens.
    assert e.block_pool.reset_prefix_cache()
    extension = list(range(900, 900 + BS + 1))
    scheduled_before = e.stats.scheduled_tokens
    b = e.add_request(prompt + extension, max_tokens=1)
    e.run()
    assert e.stats.scheduled_tokens - scheduled_before == len(extension)
    assert e.stats.finished == {a, b}
    assert e.runner.violations == []
    assert_all_released(e)


@pytest.mark.parametrize(
    ("full_multiple", "swa_multiple"),
    [(2, 1), (1, 2)],
    ids=["full-blocks-larger", "window-blocks-larger"],
)
def test_a_flush_counts_each_groups_blocks_at_its_own_size(
    full_multiple: int, swa_multiple: int
):
    """A hybrid layout whose groups have different block sizes: one group's
    blocks hold two of the other's. A request that finishes in the step
    that computes its three-small-block prompt has stored nothing, so its
    flush must store, in each group, the blocks full at that group's own
    size. Counted at group 0's larger size, the window group's second
    block is never stored, and a later prompt extending this one finds no
    CPU hit: a hit ends on a multiple of both sizes (two small blocks
    here), and the window group lacks a block of it."""
    cfg = HarnessConfig(
        block_size=BS,
        hybrid=True,
        full_block_multiple=full_multiple,
        swa_block_multiple=swa_multiple,
        num_gpu_blocks=32,
        num_cpu_blocks=32,
        max_num_batched_tokens=4 * BS,
    )
    e = Engine(cfg)
    prompt = list(range(100, 100 + 3 * BS))
    a = e.add_request(prompt, max_tokens=1)
    e.step()
    assert e.stats.finished == {a}, "finished in the step of its whole prompt"
    e.run()
    assert lost_or_wrong_cpu_blocks(e, [a]) == []

    # Only the CPU has the prompt now: the extension loads the hit, one
    # large block and two small ones.
    assert e.block_pool.reset_prefix_cache()
    b = e.add_request(prompt + list(range(900, 900 + BS + 1)), max_tokens=1)
    e.run()
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert sum(len(x["pairs"]) for x in loads) == 3
    assert e.stats.finished == {a, b}
    assert e.runner.violations == []
    assert_all_released(e)
