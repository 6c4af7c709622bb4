"""Reproducer: blocks for external tokens must not take another group's hit.

A request that has both prefix-cache hits and external computed tokens (a
KV connector such as SimpleCPUOffload loads the rest) goes through
allocate_new_computed_blocks group by group: touch this group's hits, then
allocate this group's blocks for the external tokens. A later group's hits
are still untouched in the free queue at that point, so on the unpatched
base the earlier group's allocation can evict one and take it over: one
block then holds full attention data for one position and sliding window
data for another. Nothing crashes; the KV cache is silently wrong. Found by
checking the KV cache manager after every step of the offload harness.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from harness.invariants import assert_manager_ok
from harness.kv_manager import (
    computed_blocks,
    hashed_request,
    make_kv_cache_manager,
    make_layout_manager,
)

BS = 16


def make_request(req_id: str, tokens: list[int]) -> Request:
    return hashed_request(req_id, tokens, BS, max_tokens=4)


def test_external_tokens_do_not_take_another_groups_prefix_hit():
    full = FullAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    swa = SlidingWindowSpec(
        block_size=BS,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=2 * BS,
    )
    # 46 usable blocks: a blocker's 30 and the first request's 16 fill them.
    manager = make_kv_cache_manager(
        KVCacheConfig(
            num_blocks=47,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["full"], full),
                KVCacheGroupSpec(["swa"], swa),
            ],
        ),
        max_model_len=4096,
        block_size=BS,
        max_tokens_per_step=512,
    )
    blocker = make_request("blocker", list(range(9000, 9000 + 15 * BS)))
    assert manager.allocate_slots(blocker, 15 * BS) is not None
    prompt = list(range(8 * BS))
    first = make_request("first", prompt)
    assert manager.allocate_slots(first, 8 * BS) is not None
    first.num_computed_tokens = 8 * BS
    assert manager.block_pool.get_num_free_blocks() == 0
    # Free queue now: the first request's full attention blocks, then its
    # sliding window blocks, then the blocker's.
    manager.free(first)
    manager.free(blocker)

    second = make_request("second", prompt + list(range(500, 500 + 4 * BS)))
    hits, num_hit_tokens = computed_blocks(manager, second)
    assert num_hit_tokens == 8 * BS
    swa_hit = hits.blocks[1][-1]
    # 8 hit blocks, then one block the connector loads, then new tokens.
    assert (
        manager.allocate_slots(
            second,
            BS,
            num_new_computed_tokens=num_hit_tokens,
            new_computed_blocks=hits,
            num_external_computed_tokens=BS,
        )
        is not None
    )
    full_ids, swa_ids = manager.get_block_ids("second")
    # The sliding window hit is still the block at its position, and only there.
    assert swa_ids[7] == swa_hit.block_id
    assert swa_hit.block_id not in full_ids, (
        f"block {swa_hit.block_id} is both a full attention block and the "
        "sliding window hit"
    )
    assert_manager_ok(manager)


def test_cross_attention_takes_no_blocks_for_external_tokens():
    """Encoder-decoder with a connector: external tokens are decoder KV.
    The cross-attention group holds the encoder's blocks only, as on the
    base, whichever step the coordinator splits allocation into."""
    manager = make_layout_manager(("full", "cross"), 64, BS, max_model_len=4096)
    req = make_request("enc-dec", list(range(6 * BS)))
    blocks = manager.allocate_slots(
        req,
        BS,
        num_external_computed_tokens=4 * BS,
        delay_cache_blocks=True,
        num_encoder_tokens=2 * BS,
    )
    assert blocks is not None
    full, cross = (len(ids) for ids in manager.get_block_ids(req.request_id))
    assert (full, cross) == (5, 2)
    manager.free(req)
    assert_manager_ok(manager, all_done=True)


def test_one_groups_allocate_new_computed_blocks_still_does_all_three_steps():
    """The single-group entry point (upstream's own tests call it) still
    registers the request, takes the blocks for its external tokens and
    says whether it registered it; a request it knows gets nothing."""
    manager = make_layout_manager(("full",), 32, BS, max_model_len=1024)
    group = manager.coordinator.single_type_managers[0]
    free = manager.block_pool.get_num_free_blocks()
    assert group.allocate_new_computed_blocks("r0", [], 0, 3 * BS) is True
    blocks = group.req_to_blocks["r0"]
    assert len(blocks) == 3
    assert group.new_block_ids[-3:] == [b.block_id for b in blocks]
    assert manager.block_pool.get_num_free_blocks() == free - 3
    assert group.allocate_new_computed_blocks("r0", [], 0, 3 * BS) is False
    assert len(group.req_to_blocks["r0"]) == 3
    assert manager.block_pool.get_num_free_blocks() == free - 3
