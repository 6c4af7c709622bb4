"""Reproducer for a lazy SimpleCPUOffload tier serving a hit finer than a
block (ledger row offload-lazy-partial-hit-assert, 0.26.0-0.29.0).

With prefix_match_unit finer than the blocks (a Mamba "align" hybrid), the
GPU caches the block holding a prompt's tail under the key of its last hash
boundary, inside the block. Lazy mode's scan copies free cached GPU blocks
to the CPU under their own keys, so that key reaches the CPU tier, whose
coordinator serves hits at the hash granularity like the GPU's. A request
that extends the prompt then gets a CPU hit that ends inside an attention
block (40 tokens with blocks of 16), the scheduler accepts it, and the
connector's update_state_after_alloc asserts that the hit is a multiple of
every group's block size: EngineCore dies in schedule(). Eager mode stores
whole blocks only before 0.30.0 and never reaches it. 0.30.0 builds a lazy
CPU tier that serves block-aligned hits only; the fix does the same.
"""

from __future__ import annotations

from harness.prefix_match_unit import (
    PMU_PROMPT,
    first_chunk_and_loads,
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
