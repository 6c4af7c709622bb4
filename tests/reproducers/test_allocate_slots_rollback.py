"""Reproducer for patch 0002: a refused allocate_slots leaves nothing behind.

KVCacheManager.allocate_slots checks its block count, touches the prefix
hits, then allocates group by group from the shared pool. When the pool
refuses blocks its count promised (a pool shared with another engine, or a
count that lies), the unpatched base raises out of allocate_slots and the
groups before the short one keep their new blocks. With the series it
gives back everything the call took, across all groups, and returns None.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from harness.invariants import assert_manager_ok, manager_snapshot
from harness.kv_manager import computed_blocks, make_kv_cache_manager
from harness.peer import PeerEngine

BS = 16
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)

SPECS = {
    "full": lambda: FullAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32
    ),
    "swa": lambda: SlidingWindowSpec(
        block_size=BS,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=2 * BS,
    ),
    "mamba_align": lambda: MambaSpec(
        block_size=BS,
        shapes=((1, 1),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
    ),
}
LAYOUTS = [("full",), ("full", "swa"), ("swa", "full"), ("full", "mamba_align")]


def make_manager(layout: tuple[str, ...], num_blocks: int) -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}"], SPECS[kind]())
            for i, kind in enumerate(layout)
        ],
    )
    return make_kv_cache_manager(
        config, max_model_len=4096, block_size=BS, max_tokens_per_step=256
    )


def make_request(req_id: str, tokens: list[int]) -> Request:
    return Request(
        req_id, tokens, SamplingParams(max_tokens=64), None, block_hasher=HASHER
    )


def schedule(manager: KVCacheManager, req: Request, num_tokens: int) -> bool:
    """One scheduler step for `req`: allocate `num_tokens` new tokens (with
    the prefix hits of a request that holds nothing yet) and count them as
    computed. False if allocate_slots refused."""
    hits, num_hit_tokens = None, 0
    if req.num_computed_tokens == 0:
        hits, num_hit_tokens = computed_blocks(manager, req)
        num_tokens = min(num_tokens, req.num_tokens - num_hit_tokens)
    blocks = manager.allocate_slots(
        req,
        num_tokens,
        num_new_computed_tokens=num_hit_tokens,
        new_computed_blocks=hits,
    )
    if blocks is None:
        return False
    req.num_computed_tokens += num_hit_tokens + num_tokens
    return True


def refuse_and_compare(
    manager: KVCacheManager, req: Request, num_tokens: int, after_calls: int
) -> None:
    """The pool refuses the call `after_calls` get_new_blocks calls in:
    allocate_slots returns None and, once the peer gives its blocks back,
    the manager is as it was."""
    peer = PeerEngine(manager.block_pool)
    # allocate_slots frees out-of-window blocks even when it returns None.
    manager.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
    before = manager_snapshot(manager)
    peer.arm(after_calls)
    assert not schedule(manager, req, num_tokens)
    assert peer.strikes, "the peer should have taken blocks"
    peer.release()
    assert manager_snapshot(manager) == before
    assert manager.last_shortfall.refusal is not None
    assert_manager_ok(manager)


@pytest.mark.parametrize("after_calls", [0, 1], ids=["first-group", "second-group"])
def test_refusal_mid_prefill_gives_back_every_group(after_calls):
    manager = make_manager(("full", "swa"), num_blocks=40)
    req = make_request("r0", list(range(200)))
    assert schedule(manager, req, 64)
    refuse_and_compare(manager, req, 64, after_calls)
    # Nothing was lost: the request goes on and finishes cleanly.
    assert schedule(manager, req, 64)
    manager.free(req)
    assert_manager_ok(manager, all_done=True)


@pytest.mark.parametrize("after_calls", [0, 1], ids=["first-group", "second-group"])
def test_refusal_gives_back_touched_prefix_hits(after_calls):
    manager = make_manager(("full", "swa"), num_blocks=40)
    first = make_request("r0", list(range(160)))
    assert schedule(manager, first, 160)
    manager.free(first)  # its blocks stay cached, evictable
    second = make_request("r1", list(range(160)) + list(range(500, 600)))
    hits, num_hit_tokens = computed_blocks(manager, second)
    assert num_hit_tokens > 0
    refuse_and_compare(manager, second, 100, after_calls)
    # The hits are free again, and still hit.
    assert computed_blocks(manager, second)[1] == num_hit_tokens
    assert all(b.ref_cnt == 0 for group in hits.blocks for b in group if not b.is_null)


def test_refusal_keeps_mamba_align_state():
    manager = make_manager(("full", "mamba_align"), num_blocks=40)
    req = make_request("r0", list(range(200)))
    assert schedule(manager, req, 64)
    refuse_and_compare(manager, req, 64, after_calls=1)
    assert schedule(manager, req, 64)
    manager.free(req)
    assert_manager_ok(manager, all_done=True)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_lying_count_is_a_refusal_logged_once_per_event():
    # The free queue counts 6 blocks more than it links, as after seed 000's
    # double free: every retry is refused, but logged once, with the numbers.
    manager = make_manager(("full", "swa"), num_blocks=24)
    queue = manager.block_pool.free_block_queue
    real_free = queue.num_free_blocks
    queue.num_free_blocks += 6
    log = logging.getLogger("vllm.v1.core.kv_cache_manager")
    records, level = Records(), log.level
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    try:
        req = make_request("r0", list(range(16 * (real_free // 2 + 2))))
        for _ in range(5):
            assert not schedule(manager, req, req.num_tokens)
        other = make_request("r1", list(range(500, 500 + 16 * (real_free // 2 + 2))))
        assert not schedule(manager, other, other.num_tokens)
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    assert manager.num_refusals == 6
    warnings = [r.getMessage() for r in records.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "request r0 needs" in warnings[0] and "group 1:" in warnings[0]
    assert "request r1 needs" in warnings[1]
    assert_manager_ok_but_count(manager, extra=6)


def assert_manager_ok_but_count(manager: KVCacheManager, extra: int) -> None:
    """Nothing was taken: only the planted miscount is left."""
    manager.block_pool.free_block_queue.num_free_blocks -= extra
    assert_manager_ok(manager, all_done=True)


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), data=st.data())
def test_random_refusals_leave_the_manager_unchanged(layout, data):
    manager = make_manager(layout, num_blocks=data.draw(st.integers(16, 48)))
    peer = PeerEngine(manager.block_pool)
    prefixes = [list(range(1000 * k, 1000 * k + 160)) for k in (1, 2)]
    live: list[Request] = []
    for n in range(data.draw(st.integers(4, 24))):
        op = data.draw(st.sampled_from(["add", "step", "step", "free"]))
        if op == "add" or not live:
            tokens = prefixes[data.draw(st.integers(0, 1))][
                : data.draw(st.integers(1, 160))
            ]
            live.append(make_request(f"r{n}", tokens + [7, n, 9]))
            continue
        req = data.draw(st.sampled_from(live))
        if op == "free":
            manager.free(req)
            live.remove(req)
            continue
        if req.num_computed_tokens >= req.num_tokens:
            req.append_output_token_ids(11)  # a decode step
        num_tokens = min(
            data.draw(st.integers(1, 64)), req.num_tokens - req.num_computed_tokens
        )
        strike = data.draw(st.none() | st.integers(0, 2))
        manager.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        before = manager_snapshot(manager)
        if strike is not None:
            peer.arm(strike)
        ok = schedule(manager, req, num_tokens)
        peer.disarm()
        if peer.held:
            assert not ok, "a struck call cannot succeed"
            peer.release()
        if not ok:
            assert manager_snapshot(manager) == before
        assert_manager_ok(manager)
    for req in live:
        manager.free(req)
    assert_manager_ok(manager, all_done=True)
