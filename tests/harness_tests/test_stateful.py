"""Hypothesis state machines over vLLM's free block queue and block pool.

Random sequences of the operations the scheduler and the offload connector
perform (allocate, cache, touch, free, evict, pop, remove), with the pool's
invariants checked after every step against a plain-Python model. The
example budget is small in `make test` and larger in `make soak`
(HYPOTHESIS_PROFILE=soak, see tests/conftest.py).
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.request import Request

from harness.invariants import pool_snapshot, pool_violations, queue_snapshot

BLOCK_SIZE = 4
NUM_BLOCKS = 24
init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)


class FreeQueueMachine(RuleBasedStateMachine):
    """The queue against a list: same blocks, same order, after every op."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = [KVCacheBlock(i) for i in range(NUM_BLOCKS)]
        self.queue = FreeKVCacheBlockQueue(list(self.blocks))
        self.model = list(range(NUM_BLOCKS))

    def outside(self) -> list[int]:
        return sorted(set(range(NUM_BLOCKS)) - set(self.model))

    @rule(n=st.integers(0, NUM_BLOCKS + 2))
    def popleft_n(self, n: int) -> None:
        if n > len(self.model):
            before = queue_snapshot(self.queue)
            with pytest.raises((ValueError, AssertionError)):
                self.queue.popleft_n(n)
            assert queue_snapshot(self.queue) == before
            return
        popped = self.queue.popleft_n(n)
        assert [b.block_id for b in popped] == self.model[:n]
        del self.model[:n]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.model))
        self.queue.remove(self.blocks[block_id])
        self.model.remove(block_id)

    @precondition(lambda self: len(self.model) < NUM_BLOCKS)
    @rule(data=st.data())
    def append_n(self, data: st.DataObject) -> None:
        ids = data.draw(
            st.lists(st.sampled_from(self.outside()), min_size=1, unique=True)
        )
        self.queue.append_n([self.blocks[i] for i in ids])
        self.model += ids

    @invariant()
    def matches_model(self) -> None:
        snap = queue_snapshot(self.queue)
        assert snap["problem"] is None
        assert snap["order"] == self.model
        assert snap["num_free_blocks"] == len(self.model)


class BlockPoolMachine(RuleBasedStateMachine):
    """The pool's ref counts, free list and prefix cache under random use."""

    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(
            NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE
        )
        self.refs = [0] * NUM_BLOCKS  # our count of each block's holders
        self.requests: list[Request] = []

    @rule(target=held, n=st.integers(0, NUM_BLOCKS))
    def allocate(self, n: int):
        free = self.pool.get_num_free_blocks()
        if n > free:
            before = pool_snapshot(self.pool)
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(n)
            assert pool_snapshot(self.pool) == before
            return []
        blocks = self.pool.get_new_blocks(n)
        for b in blocks:
            self.refs[b.block_id] += 1
        return blocks

    @rule(blocks=held, prompt=st.integers(0, 3))
    def cache(self, blocks: list, prompt: int) -> None:
        """Cache a run of held blocks as a prompt's full blocks.

        A few shared prompts make different blocks carry the same hash, as
        when two requests compute the same prefix.
        """
        fresh = [b for b in blocks if b.block_hash is None]
        if not fresh:
            return
        tokens = [prompt * 1000 + i for i in range(len(fresh) * BLOCK_SIZE)]
        req = Request(
            str(len(self.requests)),
            tokens,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=HASHER,
        )
        self.requests.append(req)
        self.pool.cache_full_blocks(req, fresh, 0, len(fresh), BLOCK_SIZE, 0)

    @rule(target=held, data=st.data())
    def touch_cached(self, data: st.DataObject):
        """A prefix hit: take another ref on cached blocks, free or not."""
        cached = [b for b in self.pool.blocks if b.block_hash is not None]
        if not cached:
            return []
        picked = data.draw(
            st.lists(
                st.sampled_from(cached), max_size=4, unique_by=lambda b: b.block_id
            )
        )
        self.pool.touch(picked)
        for b in picked:
            self.refs[b.block_id] += 1
        return picked

    @rule(blocks=consumes(held))
    def free(self, blocks: list) -> None:
        self.pool.free_blocks(reversed(blocks))
        for b in blocks:
            self.refs[b.block_id] -= 1

    @rule(ids=st.sets(st.integers(1, NUM_BLOCKS - 1), max_size=4))
    def evict(self, ids: set[int]) -> None:
        self.pool.evict_blocks(ids)

    @invariant()
    def consistent(self) -> None:
        assert pool_violations(self.pool) == []
        held_refs = [b.ref_cnt for b in self.pool.blocks[1:]]
        assert held_refs == self.refs[1:]


test_free_queue = FreeQueueMachine.TestCase
test_block_pool = BlockPoolMachine.TestCase
