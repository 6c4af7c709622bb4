"""Reproducer for patch 0001: a refused pop is a typed error and changes nothing.

On the unpatched base, FreeKVCacheBlockQueue.popleft_n asserts (seed 000's
EngineCore crash) and, when the queue's count is larger than its list, it
unlinks blocks (and the fake tail) before the assertion fires.

Two errors, two meanings: NoFreeBlocksError (a ValueError) is a shortage,
which the scheduler waits out; KVCacheCorruptionError (not a ValueError) is
a queue that counts more blocks than it links, which no wait can mend.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from harness.invariants import assert_pool_ok, pool_snapshot, queue_snapshot


def expect_no_free_blocks(fn, requested: int) -> None:
    """`fn()` must raise NoFreeBlocksError (a ValueError) naming `requested`.

    The name is checked rather than imported so this runs on the base too,
    where it fails because popleft_n raises AssertionError instead.
    """
    with pytest.raises(ValueError) as info:
        fn()
    err = info.value
    assert type(err).__name__ == "NoFreeBlocksError", repr(err)
    assert err.num_requested == requested
    assert err.num_free < requested


def expect_corruption(fn, counted: int, linked: int) -> None:
    """`fn()` must raise KVCacheCorruptionError, which is not a ValueError
    (nothing may take it for a shortage and retry), naming both counts."""
    with pytest.raises(Exception) as info:
        fn()
    err = info.value
    assert type(err).__name__ == "KVCacheCorruptionError", repr(err)
    assert not isinstance(err, ValueError)
    assert f"counts {counted} free blocks but links only {linked}" in str(err)


def make_queue(n: int) -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return FreeKVCacheBlockQueue(blocks), blocks


def test_refused_pop_is_typed_and_changes_nothing():
    queue, blocks = make_queue(4)
    queue.remove(blocks[1])
    before = queue_snapshot(queue)
    expect_no_free_blocks(lambda: queue.popleft_n(4), 4)
    assert queue_snapshot(queue) == before


def test_pop_from_miscounted_queue_changes_nothing():
    # The state seed 000 ends in: the count says more blocks are free than
    # the list links (a block appended twice, a ref count out of balance).
    queue, _ = make_queue(3)
    queue.num_free_blocks += 2
    before = queue_snapshot(queue)
    expect_corruption(lambda: queue.popleft_n(4), counted=5, linked=3)
    assert queue_snapshot(queue) == before
    # The message names the blocks the list does link.
    with pytest.raises(Exception, match=r"block ids 0, 1, 2; asked for 4"):
        queue.popleft_n(4)


@pytest.mark.parametrize(
    ("linked", "listed"),
    [
        (10, "0, 1, 2, 3, 4, 5, 6, 7, 8, 9"),
        (11, "0, 1, 2, 3, 4, ..., 6, 7, 8, 9, 10"),
    ],
)
def test_the_message_lists_up_to_ten_block_ids(linked, listed):
    # Ten ids are named; more are cut to the first and last five, so that a
    # large pool's message stays one line.
    queue, _ = make_queue(linked)
    queue.num_free_blocks += 2
    with pytest.raises(Exception) as info:
        queue.popleft_n(linked + 1)
    assert f"block ids {listed}; asked for {linked + 1}" in str(info.value)


@pytest.mark.parametrize("miscount", [1, -1], ids=["count-high", "count-low"])
def test_pop_that_ends_where_the_count_disagrees_changes_nothing(miscount):
    # A pop that stays inside the list still shows a wrong count when it
    # ends: at the fake tail while more are counted, or before the tail
    # with the count used up. Caught there, not later by another pop.
    queue, _ = make_queue(5)
    queue.num_free_blocks += miscount
    n = 5 if miscount > 0 else 4
    before = queue_snapshot(queue)
    with pytest.raises(Exception) as info:
        queue.popleft_n(n)
    assert type(info.value).__name__ == "KVCacheCorruptionError", repr(info.value)
    found = "links only 5" if miscount > 0 else "links more than 4"
    assert f"counts {5 + miscount} free blocks but {found}" in str(info.value)
    assert queue_snapshot(queue) == before


@pytest.mark.parametrize(
    ("linked", "counted", "found"),
    [(1, 2, "links only 1"), (2, 1, "links more than 1"), (0, 1, "links only 0")],
    ids=["count-high", "count-low", "empty-list"],
)
def test_single_block_pop_that_disagrees_with_the_count_changes_nothing(
    linked, counted, found
):
    # A pop of one block (decode's) takes a short path of its own; a list
    # that disagrees with the count must still be reported from it, and
    # left as it was.
    queue, _ = make_queue(linked)
    queue.num_free_blocks = counted
    before = queue_snapshot(queue)
    with pytest.raises(Exception) as info:
        queue.popleft_n(1)
    assert type(info.value).__name__ == "KVCacheCorruptionError", repr(info.value)
    assert f"counts {counted} free blocks but {found}" in str(info.value)
    assert queue_snapshot(queue) == before


def test_single_block_pop_from_a_broken_head_link_is_corruption():
    # The fake head links nothing (a broken list): no AttributeError from
    # the short path, the same report as a pop of more blocks.
    queue, _ = make_queue(2)
    queue.fake_free_list_head.next_free_block = None
    before = queue_snapshot(queue)
    with pytest.raises(Exception) as info:
        queue.popleft_n(1)
    assert type(info.value).__name__ == "KVCacheCorruptionError", repr(info.value)
    assert "counts 2 free blocks but links only 0" in str(info.value)
    assert queue_snapshot(queue) == before


def test_pool_refusal_is_typed_and_changes_nothing():
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    held = pool.get_new_blocks(5)
    before = pool_snapshot(pool)
    expect_no_free_blocks(lambda: pool.get_new_blocks(3), 3)
    assert pool_snapshot(pool) == before
    pool.free_blocks(held)
    assert_pool_ok(pool, all_done=True)


def test_a_negative_pop_is_refused_and_changes_nothing():
    """A block count gone negative before it reaches the pool (vllm-ascend
    #14283) must not pass: popping -k blocks pops none and raises the free
    count by k, past the blocks in the list, the very disagreement the
    pool's other checks report. popleft_n and get_new_blocks refuse it with
    a ValueError and change nothing."""
    for n in (-1, -3):
        queue, _ = make_queue(8)
        before = queue_snapshot(queue)
        with pytest.raises(ValueError):
            queue.popleft_n(n)
        assert queue_snapshot(queue) == before
        pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
        before = pool_snapshot(pool)
        with pytest.raises(ValueError):
            pool.get_new_blocks(n)
        assert pool_snapshot(pool) == before
        assert_pool_ok(pool, all_done=True)


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(0, 40),
    removed=st.sets(st.integers(0, 39)),
    extra=st.integers(1, 5),
    miscount=st.integers(0, 3),
)
def test_random_refusals_leave_queue_unchanged(size, removed, extra, miscount):
    queue, blocks = make_queue(size)
    for i in sorted(removed):
        if i < size:
            queue.remove(blocks[i])
    queue.num_free_blocks += miscount
    before = queue_snapshot(queue)
    linked = len(before["order"])
    n = linked + extra
    if n > queue.num_free_blocks:
        # More than the count: a shortage, whatever the list holds.
        expect_no_free_blocks(lambda: queue.popleft_n(n), n)
    else:
        # Within the count, beyond the list: the count is wrong.
        expect_corruption(lambda: queue.popleft_n(n), queue.num_free_blocks, linked)
    assert queue_snapshot(queue) == before


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 40), data=st.data())
def test_served_pops_take_the_head_in_order(size, data):
    queue, _ = make_queue(size)
    n = data.draw(st.integers(0, size))
    order = queue_snapshot(queue)["order"]
    popped = queue.popleft_n(n)
    assert [b.block_id for b in popped] == order[:n]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    after = queue_snapshot(queue)
    assert after["problem"] is None
    assert after["order"] == order[n:]
    assert after["num_free_blocks"] == size - n
