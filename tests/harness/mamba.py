"""Mamba hybrid layouts for the tests: an engine per mamba_cache_mode, the
release's refusal of a connector's load with an align group as a skip, a
prompt left on the CPU only, for a later request to load, one whose last
attention blocks left the GPU prefix cache while its Mamba state stayed,
and the groups marked EAGLE/MTP as a model with a drafter has them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, get_args

import pytest

from harness.engine import Engine, HarnessConfig

PROMPT = list(range(100, 148))  # three blocks of 16


def mamba_engine(mode: str, **overrides: Any) -> Engine:
    """A full-attention + Mamba layout with SimpleCPUOffload in prefix-caching
    `mode`, or a skip where the release has no such mode."""
    from vllm.config.cache import MambaCacheMode

    if mode not in get_args(MambaCacheMode):
        pytest.skip(f"this release has no mamba_cache_mode {mode!r}")
    cfg = dict(
        mamba=mode, num_gpu_blocks=32, num_cpu_blocks=32, max_num_batched_tokens=128
    )
    return Engine(HarnessConfig(**(cfg | overrides)))


@contextmanager
def skip_where_a_load_is_refused(mode: str) -> Iterator[None]:
    """0.19.0-0.22.1 stop a KV connector's load with an align group by an
    assertion: a skip there, not a failure."""
    try:
        yield
    except AssertionError as error:
        if "External KV connector is not verified yet" not in str(error):
            raise
        pytest.skip(f"this release refuses a load with a Mamba {mode} group")


def prompt_on_the_cpu_only(
    e: Engine, prompt: list[int] = PROMPT, max_tokens: int = 3
) -> None:
    """Compute `prompt` (and `max_tokens` tokens past it), let the connector
    store it, and drop the GPU prefix cache: a later request with this
    prefix loads it from the CPU."""
    e.add_request(prompt, max_tokens=max_tokens)
    e.run()
    assert e.block_pool.reset_prefix_cache()


def _cached_blocks_evicted(
    e: Engine, prompt: list[int], kept: tuple[int | None, int | None]
) -> None:
    """Compute `prompt` (the connector stores it to the CPU), then evict from
    the GPU prefix cache its blocks of group 0 (full attention) and group 1
    (the Mamba group) past the first `kept[g]` (None: keep them all), as
    block pressure can."""
    req_id = e.add_request(prompt, max_tokens=3)
    request = e.scheduler.requests[req_id]
    # Read once the whole prompt is computed (a release may split it into
    # chunks at Mamba block boundaries), while the request holds its blocks.
    for _ in range(len(prompt)):  # a token a step at the least
        if request.num_computed_tokens >= len(prompt):
            break
        e.step()
    assert request.num_computed_tokens >= len(prompt), "the prompt never ran"
    block_ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)
    e.run()
    evict_cached_past(e, block_ids, kept)


def evict_cached_past(
    e: Engine, block_ids: tuple[list[int], ...], kept: tuple[int | None, ...]
) -> None:
    """Evict from the GPU prefix cache each group's blocks of `block_ids`
    (a request's, per group, read while it held them) past the first
    `kept[g]` (None: keep them all), as block pressure can."""
    for ids, keep in zip(block_ids, kept, strict=True):
        if keep is None:
            continue
        for block_id in ids[keep:]:
            e.block_pool._maybe_evict_cached_block(e.block_pool.blocks[block_id])


def attention_evicted_past_the_mamba_state(
    e: Engine, prompt: list[int], kept_blocks: int
) -> None:
    """`prompt` computed, its attention blocks after the first `kept_blocks`
    evicted while its Mamba state block stays cached: for a request that
    extends `prompt` the Mamba group hits deeper than full attention."""
    _cached_blocks_evicted(e, prompt, (kept_blocks, None))


def mamba_state_evicted_under_the_attention(
    e: Engine, prompt: list[int], attention_kept: int | None = None
) -> None:
    """`prompt` computed, its Mamba state blocks evicted while its attention
    blocks (the first `attention_kept`, default all) stay cached: for a
    request that extends `prompt` full attention hits deeper than the Mamba
    group."""
    _cached_blocks_evicted(e, prompt, (attention_kept, 0))


def attention_blocks(e: Engine, req_id: str) -> set[int]:
    """The request's blocks in the groups whose new blocks are zeroed (not
    the Mamba group's)."""
    groups = e.kv_cache_config.kv_cache_groups
    ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)
    return {
        b
        for group, group_ids in zip(groups, ids, strict=False)
        if "Mamba" not in type(group.kv_cache_spec).__name__
        for b in group_ids
    }


def enable_eagle(e: Engine) -> None:
    """Mark every KV cache group of the hybrid coordinator as an EAGLE/MTP
    group, as a model with an EAGLE drafter has them (the harness has no
    drafter: only the prefix lookup's EAGLE rules are exercised)."""
    coordinator = e.scheduler.kv_cache_manager.coordinator
    groups = coordinator.attention_groups
    if hasattr(coordinator, "eagle_attn_group_indices"):  # 0.20.0-0.25.1
        coordinator.eagle_attn_group_indices = set(range(len(groups)))
    elif "use_eagle" in getattr(groups[0], "_fields", ()):  # 0.26.0 on
        coordinator.attention_groups = [g._replace(use_eagle=True) for g in groups]
        for manager in coordinator.single_type_managers:
            manager.use_eagle = True
    else:  # 0.19.x: one flag for the coordinator
        coordinator.use_eagle = True
    if hasattr(coordinator, "eagle_group_ids"):
        coordinator.eagle_group_ids = set(range(len(coordinator.single_type_managers)))
