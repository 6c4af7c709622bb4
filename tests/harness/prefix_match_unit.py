"""A Mamba hybrid hashed finer than its blocks (vLLM's prefix_match_unit):
the engine, a prompt whose last hash boundary lies inside an attention
block, and that prompt's tail left on a lazy CPU tier only."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from vllm.v1.core import kv_cache_utils

from harness.engine import Engine
from harness.mamba import mamba_engine
from harness.offload_checks import new_request

# 44 tokens: with an 8-token prefix_match_unit the prompt's last hash
# boundary (40) lies inside attention block #2 (tokens 32-47), where the
# release caches the prompt's tail under a key finer than a block.
PMU_PROMPT = list(range(100, 144))
PMU = 8


def pmu_engine(**overrides: Any) -> Engine:
    """Full attention 16 + Mamba "align" 16 with SimpleCPUOffload, hashed
    every 8 tokens, or a skip where the release has no prefix_match_unit
    (before 0.26.0)."""
    from vllm.config import CacheConfig

    if "prefix_match_unit" not in {f.name for f in dataclasses.fields(CacheConfig)}:
        pytest.skip("no prefix_match_unit in this release")
    return mamba_engine("align", prefix_match_unit=PMU, **overrides)


def tail_on_a_lazy_cpu_only(e: Engine, prompt: list[int] = PMU_PROMPT) -> None:
    """Compute `prompt` on a lazy engine until the blocks cached under its
    last hash boundary (both groups) are on the CPU, then evict every
    cached GPU block no request holds: a later request with this prefix
    finds it on the CPU only. A request decoding beside it keeps every step
    a forward, so that the lazy stores launch on releases whose idle engine
    launches none (0.29.0)."""
    e.add_request(list(range(2000, 2016)), max_tokens=60)
    e.add_request(prompt, max_tokens=3)
    hash_size = e.hash_block_size
    boundary = len(prompt) // hash_size * hash_size
    tail = new_request(e, prompt).block_hashes[boundary // hash_size - 1]
    cpu = e.offload.cpu_block_pool.cached_block_hash_to_block
    for _ in range(50):
        e.step()
        if all(
            cpu.get_one_block(kv_cache_utils.make_block_hash_with_group_id(tail, g))
            for g in (0, 1)
        ):
            break
    else:
        raise AssertionError("the prompt's tail never reached the CPU")
    pool = e.block_pool
    for block in pool.blocks:
        if block.ref_cnt == 0 and block.block_hash is not None:
            pool._maybe_evict_cached_block(block)
