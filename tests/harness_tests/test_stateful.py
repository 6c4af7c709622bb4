"""Hypothesis state machines over vLLM's free block queue and block pool.

Random sequences of the operations the scheduler and the offload connector
perform (allocate, cache, touch, free, evict, pop, remove; admit, prefill,
decode, preempt and finish requests through the KV cache manager), with the
invariants checked after every step, against a plain-Python model where
there is one. The
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
    KVCacheCorruptionError,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.request import Request

from harness.invariants import (
    manager_snapshot,
    manager_violations,
    pool_snapshot,
    pool_violations,
    queue_snapshot,
)
from harness.kv_manager import computed_blocks, make_layout_manager
from harness.peer import PeerEngine

BLOCK_SIZE = 4
NUM_BLOCKS = 24
CHUNK = 3 * BLOCK_SIZE  # tokens per prefill chunk, as max_num_batched_tokens
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
            with pytest.raises(ValueError) as info:
                self.queue.popleft_n(n)
            assert type(info.value).__name__ == "NoFreeBlocksError"
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
            with pytest.raises(ValueError) as info:
                self.pool.get_new_blocks(n)
            assert type(info.value).__name__ == "NoFreeBlocksError"
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


class KVCacheManagerMachine(RuleBasedStateMachine):
    """The KV cache manager driven as the scheduler drives it.

    Requests with shared prefixes are admitted (prefix hits, then a chunk;
    some with external tokens, as a connector's load), prefilled in chunks,
    decoded token by token, preempted when an allocation is refused,
    finished, and cached blocks are evicted. A peer engine sharing the pool
    (kvcached's case) takes blocks between the manager's count and its
    grab, so allocations are refused where the count allowed them: a
    refused call must leave the manager exactly as it was (every group,
    new_block_ids and Mamba state included). The groups: LAYOUT, in the
    subclasses below in every order. After every rule: each held block is
    allocated once per holder and in one group, and the pool's free list
    matches its count.
    """

    LAYOUT: tuple[str, ...] = ("full", "swa")

    def __init__(self) -> None:
        super().__init__()
        self.kvm = make_layout_manager(
            self.LAYOUT, NUM_BLOCKS * 2, BLOCK_SIZE, max_model_len=512
        )
        self.peer = PeerEngine(self.kvm.block_pool)
        self.running: dict[str, Request] = {}
        # Refused admissions wait and are retried; the scheduler frees them
        # (free() of a request that holds nothing) when they finish or abort.
        self.waiting: dict[str, Request] = {}
        self.ids = 0
        self.refusals = 0
        # Allocations vLLM's own count got wrong (KVCacheCorruptionError).
        self.wrong_counts = 0

    def allocate(self, req: Request, num_new: int, **kwargs) -> bool:
        """allocate_slots, with what a refusal must leave checked."""
        self.kvm.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        before = manager_snapshot(self.kvm)
        try:
            ok = self.kvm.allocate_slots(req, num_new, **kwargs) is not None
        except KVCacheCorruptionError:
            # vLLM counted fewer blocks than the allocation then took, with
            # no peer striking: 0002 says so loudly, having given back what
            # the call took (checked below). Seen only with align-mode
            # Mamba groups, whose count on these releases is upstream's.
            assert not self.peer.held and "mamba_align" in self.LAYOUT
            self.wrong_counts += 1
            ok = False
        struck = bool(self.peer.held)
        self.peer.disarm()
        self.peer.release()
        if struck:
            assert not ok, "a call the peer made short cannot succeed"
            self.refusals += 1
        if not ok:
            assert manager_snapshot(self.kvm) == before
        return ok

    def admit(self, req: Request, num_external: int = 0) -> bool:
        computed, num_local = (
            computed_blocks(self.kvm, req) if self.kvm.enable_caching else (None, 0)
        )
        num_external = min(num_external, req.num_tokens - num_local - 1)
        num_new = min(CHUNK, req.num_tokens - num_local - num_external)
        if not self.allocate(
            req,
            num_new,
            num_new_computed_tokens=num_local,
            new_computed_blocks=computed,
            num_external_computed_tokens=max(0, num_external),
        ):
            return False
        req.num_computed_tokens = num_local + max(0, num_external) + num_new
        self.waiting.pop(req.request_id, None)
        self.running[req.request_id] = req
        return True

    @rule(
        prefix=st.integers(0, 2),
        extra=st.integers(1, 6 * BLOCK_SIZE),
        external=st.sampled_from([0, 0, BLOCK_SIZE, 3 * BLOCK_SIZE]),
    )
    def new_request(self, prefix: int, extra: int, external: int) -> None:
        self.ids += 1
        tokens = [prefix * 1000 + i for i in range(4 * BLOCK_SIZE)]
        tokens += [self.ids * 10_000 + i for i in range(extra)]
        req = Request(
            f"r{self.ids}",
            tokens,
            SamplingParams(max_tokens=64),
            None,
            block_hasher=HASHER,
        )
        if not self.admit(req, external):
            self.waiting[req.request_id] = req

    @rule(after_calls=st.integers(0, 2))
    def peer_strikes(self, after_calls: int) -> None:
        """The next allocation (its get_new_blocks call `after_calls`) is
        short: a colocated engine took the blocks the count promised."""
        self.peer.arm(after_calls)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        self.admit(self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A prefill chunk or a decode token; preempt when refused."""
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if req.num_computed_tokens < req.num_tokens:
            num_new = min(CHUNK, req.num_tokens - req.num_computed_tokens)
        else:
            req.append_output_token_ids(7)
            num_new = 1
        if not self.allocate(req, num_new):
            self.kvm.free(req)  # preempted: back to waiting, holding nothing
            req.num_computed_tokens = 0
            self.waiting[req.request_id] = self.running.pop(req.request_id)
        else:
            req.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.kvm.free(req)

    @rule(ids=st.sets(st.integers(1, 2 * NUM_BLOCKS - 1), max_size=4))
    def evict(self, ids: set[int]) -> None:
        self.kvm.block_pool.evict_blocks(ids)

    @invariant()
    def consistent(self) -> None:
        assert manager_violations(self.kvm) == []

    def teardown(self) -> None:
        for req in [*self.running.values(), *self.waiting.values()]:
            self.kvm.free(req)
        assert manager_violations(self.kvm, all_done=True) == []


def machine_for(layout: tuple[str, ...]) -> type[KVCacheManagerMachine]:
    return type(
        f"KVCacheManagerMachine_{'_'.join(layout)}",
        (KVCacheManagerMachine,),
        {"LAYOUT": layout},
    )


# Every order of full attention, sliding window and align-mode Mamba groups
# (a Mamba group before another group runs its own undo of moved blocks).
LAYOUTS = [
    ("full", "swa"),
    ("swa", "full"),
    ("full", "mamba_align"),
    ("mamba_align", "full"),
    ("mamba_align", "swa", "full"),
]
for _layout in LAYOUTS:
    globals()[f"test_kv_cache_manager_{'_'.join(_layout)}"] = machine_for(
        _layout
    ).TestCase
