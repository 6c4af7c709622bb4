"""Reproducer for a lazy SimpleCPUOffload tier serving a hit finer than a
block (ledger row offload-lazy-partial-hit-assert, 0.26.0-0.29.0).

With prefix_match_unit finer than the blocks (a Mamba "align" hybrid; from
0.28.0 also a Mamba block larger than the attention block, hashed at the
attention block), the GPU caches the block holding a prompt's tail under
the key of its last hash boundary, inside the block. Lazy mode's scan
copies free cached GPU blocks to the CPU under their own keys, so that key
reaches the CPU tier, whose coordinator serves hits at the hash
granularity like the GPU's. A request that extends the prompt then gets a
CPU hit that ends inside a block (40 tokens with attention blocks of 16),
the scheduler accepts it, and the connector's update_state_after_alloc
asserts that the hit is a multiple of every group's block size: EngineCore
dies in schedule(). Eager mode stores whole blocks only before 0.30.0 and
never reaches it. 0.30.0 builds a lazy CPU tier that serves block-aligned
hits only; the fix does the same.
"""

from __future__ import annotations

import pytest

from harness.config import HarnessConfig, unsupported_layout
from harness.mamba import mamba_engine
from harness.offload_checks import first_chunk_and_loads
from harness.prefix_match_unit import (
    PMU_PROMPT,
    pmu_engine,
    tail_on_a_lazy_cpu_only,
)

EXTENSION = list(range(900, 917))


def test_a_lazy_cpu_tier_serves_a_prompt_tail_at_a_block_boundary():
    e = pmu_engine(lazy=True)
    tail_on_a_lazy_cpu_only(e)
    req_id = e.add_request(PMU_PROMPT + EXTENSION, max_tokens=2)
    (_, start, _), loaded = first_chunk_and_loads(e, req_id)
    # The hit stops at the last whole block (32 tokens): two attention
    # blocks and the Mamba state there are loaded.
    assert (start, len(loaded)) == (32, 3)
    assert req_id in e.stats.finished
    assert e.runner.violations == [] and e.cuda.races == []


def test_a_lazy_cpu_tier_serves_no_hit_inside_a_larger_mamba_block():
    """No prefix_match_unit: attention blocks of 16, Mamba blocks of 32,
    hashed every 16 tokens. A 56-token prompt's tail is cached under the
    key at 48, inside Mamba block #1: bare 0.28.0-0.29.0 serve a 48-token
    CPU hit and assert ('not aligned to group 1 block_size=32'). At the
    32-token boundary the lazy tier holds no Mamba state: no hit, the
    prompt computed again, as from 0.30.0."""
    if reason := unsupported_layout(
        HarnessConfig(mamba="align", mamba_block_multiple=2)
    ):
        pytest.skip(reason)  # up to 0.27.1: hashed at the scheduler block
    e = mamba_engine("align", mamba_block_multiple=2, lazy=True)
    prompt = list(range(100, 156))
    tail_on_a_lazy_cpu_only(e, prompt)
    req_id = e.add_request(prompt + EXTENSION, max_tokens=2)
    (_, start, _), loaded = first_chunk_and_loads(e, req_id)
    assert (start, len(loaded)) == (0, 0)
    assert req_id in e.stats.finished
    assert e.runner.violations == [] and e.cuda.races == []
