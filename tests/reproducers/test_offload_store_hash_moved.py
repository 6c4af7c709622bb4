"""Reproducer for the store-completion patch (0.30.0-0.33.0): a GPU block
whose prefix-cache hash moved to another block while its CPU store was in
flight completes its store without being cached, instead of an assertion
that kills EngineCore.

From 0.30.0 a Mamba align-mode request that keeps writing into a block the
prefix cache holds (a partial-tail hit) copies that block on write:
`BlockPool.move_block_hashes` re-points the block's hashes to the copy. The
SimpleCPUOffload connector pins a block while its GPU->CPU store is in
flight but not its hash, and on completion
`SimpleCPUOffloadScheduler._process_store_completion` asserts the block
still has one (`assert primary_hash is not None`): the AssertionError
leaves `Scheduler.update_from_output` and EngineCore dies (vllm#57505, an
open PR upstream). The harness does not build the partial-tail hit
itself: the test makes the copy-on-write's two moves (a fresh block for
the copy, the hashes moved to it, the content copied) between the step
that launches a store and the step that completes it, with the real
block pool, scheduler and connector. The lazy case (a free cached block
stored while its hash moves) is the same completion path; real moves hit
the running producer's own block, which eager mode stores.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_pool_ok

BS = 16
PROMPT = list(range(100, 133))  # two full blocks and one token


def engine(lazy: bool) -> Engine:
    # Stores complete two steps after they are launched, so that a step can
    # run between launch and completion. Lazy mode stores the cached free
    # blocks the next steps' budget would evict: in a pool that small, the
    # finished request's.
    cfg = HarnessConfig(
        block_size=BS,
        num_gpu_blocks=8 if lazy else 32,
        num_cpu_blocks=16,
        lazy=lazy,
        transfer_delay=lambda is_store: 2 if is_store else 0,
    )
    return Engine(cfg)


def step_until_a_store_is_in_flight(e: Engine) -> Any:
    """Step until the connector has a store in flight; its transfer."""
    for _ in range(40):
        e.step()
        in_flight = e.offload._store_event_to_blocks
        if in_flight:
            return next(iter(in_flight.values()))
    raise AssertionError("no store was launched")


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_store_whose_block_hash_moved_completes_uncached(lazy: bool):
    e = engine(lazy)
    pool = e.block_pool
    if not hasattr(pool, "move_block_hashes"):
        pytest.skip("this release has no copy-on-write that moves a hash")
    if lazy:
        # The finished request's blocks are stored while another runs.
        e.add_request(PROMPT, max_tokens=1)
        e.run()
        e.add_request([t + 1000 for t in PROMPT], max_tokens=8)
    else:
        e.add_request(PROMPT, max_tokens=8)
    transfer = step_until_a_store_is_in_flight(e)
    if e.offload.cpu_block_pool.blocks[transfer.cpu_block_ids[0]].block_hash:
        pytest.skip("this release names a stored block when it plans the store")
    src = pool.blocks[transfer.gpu_block_ids[0]]
    moved = src.block_hash
    assert moved is not None, "a stored block has its hash when launched"

    # The copy-on-write: a new block for the cache's copy, the hashes moved
    # to it, its content copied from the source; the cache keeps the copy.
    (copy,) = pool.get_new_blocks(1)
    pool.move_block_hashes(src, copy)
    e.kv.gpu[copy.block_id] = e.kv.gpu.get(src.block_id)
    pool.free_blocks([copy])
    assert src.block_hash is None

    cpu_pool = e.offload.cpu_block_pool
    stale = cpu_pool.blocks[transfer.cpu_block_ids[0]]
    for _ in range(10):  # the store completes: on the base, AssertionError
        if transfer not in e.offload._store_event_to_blocks.values():
            break
        e.step()
    else:
        raise AssertionError("the store never completed")
    assert stale.block_hash is None, (
        "the CPU cached the copy of a block whose hash had moved before its "
        "store completed"
    )
    rest = [cpu_pool.blocks[b] for b in transfer.cpu_block_ids[1:]]
    assert rest and all(b.block_hash is not None for b in rest), (
        "the blocks of the same store that kept their hashes were not cached"
    )
    e.run()  # (a later store may cache the copy-on-write block, rightly)
    assert_pool_ok(pool, all_done=True, label="GPU pool")
    assert_pool_ok(cpu_pool, all_done=True, label="CPU pool", hashed_means_cached=False)
