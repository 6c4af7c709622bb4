"""Build vLLM's KVCacheManager the way the running release spells it.

Its constructor changed across releases: 0.19.0 has no batch-size kwarg,
0.20.2-0.24.0 take `max_num_batched_tokens`, 0.30.0 renamed it
`max_in_flight_tokens`; 0.24.0 added a required `scheduler_block_size` next
to `hash_block_size`. Tests say what they mean once, here.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

# The first block's parent hash, as the engine sets it at start-up (as
# harness.config does too: both at import, before any request is hashed;
# without PYTHONHASHSEED each call draws a new one).
init_none_hash(sha256)


def make_kv_cache_manager(
    config: KVCacheConfig,
    *,
    max_model_len: int,
    block_size: int,
    max_tokens_per_step: int,
    enable_caching: bool = True,
    hash_block_size: int | None = None,
) -> KVCacheManager:
    """A KVCacheManager that hashes and schedules in `block_size` blocks and
    expects at most `max_tokens_per_step` new tokens per step (a bound the
    manager uses to size what it reserves; a release without the kwarg
    simply has no such bound, so it is left out there)."""
    params = inspect.signature(KVCacheManager.__init__).parameters
    kwargs: dict[str, object] = {
        "max_model_len": max_model_len,
        "hash_block_size": hash_block_size or block_size,
        "enable_caching": enable_caching,
    }
    if "scheduler_block_size" in params:
        kwargs["scheduler_block_size"] = block_size
    for name in ("max_num_batched_tokens", "max_in_flight_tokens"):
        if name in params:
            kwargs[name] = max_tokens_per_step
    return KVCacheManager(config, **kwargs)  # type: ignore[arg-type]


def computed_blocks(manager: KVCacheManager, request: Request) -> tuple[Any, int]:
    """`get_computed_blocks`'s (blocks, number of hit tokens).

    From 0.30.0 it also returns a shared-prefix boundary, which the scheduler
    keeps on the request to pin a sparse group's junction block; the tests
    here never set it, so what they see is a request without one (0)."""
    blocks, num_tokens, *_ = manager.get_computed_blocks(request)
    return blocks, num_tokens


def hashed_request(
    req_id: str, tokens: list[int], block_size: int, max_tokens: int = 64
) -> Request:
    """A request whose blocks are hashed (sha256) in `block_size` tokens, as
    the scheduler hashes them, for a manager driven without a scheduler."""
    hasher = get_request_block_hasher(block_size, sha256)
    return Request(
        req_id, tokens, SamplingParams(max_tokens=max_tokens), None, block_hasher=hasher
    )


def schedule(manager: KVCacheManager, req: Request, num_tokens: int) -> bool:
    """One scheduler step for `req`: allocate `num_tokens` new tokens (with
    the prefix hits of a request that holds nothing yet) and count them as
    computed. False if allocate_slots refused."""
    hits, num_hit_tokens = None, 0
    if req.num_computed_tokens == 0 and manager.enable_caching:
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


def group_spec(kind: str, block_size: int) -> Any:
    """The KV cache spec of one group: full, swa (a window of two blocks),
    cross (encoder-decoder cross-attention), mamba_align or mamba_align_spec
    (with a speculative block)."""
    # Imported here: not every release has every spec.
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    if kind in ("full", "cross"):
        spec = FullAttentionSpec if kind == "full" else CrossAttentionSpec
        return spec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
    if kind == "swa":
        return SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
            sliding_window=2 * block_size,
        )
    if kind in ("mamba_align", "mamba_align_spec", "mamba_align_checkpoint"):
        # mamba_align_spec: one speculative block (speculative decoding),
        # which align mode moves along as the request grows.
        # mamba_align_checkpoint: a prefill checkpoint block (from 0.29.0),
        # where a chunk that ends inside a block also keeps the state at
        # the block boundary before its end.
        checkpoint: dict[str, int] = {}
        if kind == "mamba_align_checkpoint":
            checkpoint["num_prefill_checkpoint_blocks"] = 1
            if "prefill_checkpoint_alignment" in MambaSpec.__dataclass_fields__:
                # From 0.30.0 a checkpoint needs an alignment (None: none is
                # ever valid); 1, as mamba_mixer2 sets it.
                checkpoint["prefill_checkpoint_alignment"] = 1
        return MambaSpec(
            block_size=block_size,
            shapes=((1, 1),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=1 if kind == "mamba_align_spec" else 0,
            **checkpoint,
        )
    raise ValueError(f"unknown KV cache group kind {kind}")


def make_layout_manager(
    layout: tuple[str, ...],
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    hash_block_size: int | None = None,
) -> KVCacheManager:
    """A KVCacheManager whose groups (in this order) share one pool of
    `num_blocks`. Encoder-decoder layouts (a cross-attention group) run
    without prefix caching, as vLLM runs them. Every group records the ids
    of the new blocks the worker zeroes (from 0.30 attention groups record
    them only where the worker must, for Mamba hybrids or mixed precision),
    so that every undo of them is seen. A `hash_block_size` below
    `block_size` hashes at a finer grain than the blocks: from 0.33, with a
    Mamba align group, a hit may then end inside a block (a partial hit),
    which the allocation copies on write."""
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}"], group_spec(kind, block_size))
            for i, kind in enumerate(layout)
        ],
    )
    manager = make_kv_cache_manager(
        config,
        max_model_len=max_model_len,
        block_size=block_size,
        max_tokens_per_step=256,
        enable_caching="cross" not in layout,
        hash_block_size=hash_block_size,
    )
    for group in manager.coordinator.single_type_managers:
        if hasattr(group, "_record_new_block_ids"):
            group._record_new_block_ids = True
    return manager
