"""Reproducer for a CPU hit looked up after a local hit that ends inside a
block (ledger row offload-cpu-hit-after-unaligned-local-hit, 0.26.0).

With prefix_match_unit finer than the blocks (a Mamba "align" hybrid), the
GPU serves a hit that ends inside a block: 40 tokens, with attention blocks
of 16 and a unit of 8. 0.26.0's scheduler hands that hit to the connector
as it is, and SimpleCPUOffload looks up a CPU hit from the 40th token on,
which no whole-block copy can continue. Eager mode: the hit is counted in
blocks from the hashed attention blocks, none is left to load, and
update_state_after_alloc asserts `num_blocks_to_load > 0` (EngineCore dies
in schedule()). Lazy mode: the CPU block for tokens 48-55 is loaded into the
block that holds tokens 32-47, the Mamba state into the null block, and the
request computes from 56: wrong KV, silently. The same with attention
blocks of 32 beside Mamba blocks of 16: a local hit of 48 is a multiple of
one group's block but not of the scheduler block (32). From 0.27.0 the
scheduler hands the connector a hit aligned to the scheduler block; 0.30.0's
connector also refuses a lookup after an unaligned one, a guard its
scheduler never lets fire. The fix is that guard: the request keeps its
local hit and loads nothing.
"""

from __future__ import annotations

import pytest

from harness.mamba import prompt_on_the_cpu_only
from harness.offload_checks import first_chunk_and_loads
from harness.prefix_match_unit import pmu_engine, tail_on_a_lazy_cpu_only

PROMPT = list(range(100, 200))
# (layout, tokens on the CPU, tokens computed on the GPU). Blocks of 16: the
# GPU prompt's last hash boundary (40) lies inside attention block #2
# (tokens 32-47). Attention blocks of 32 beside Mamba blocks of 16 (a
# scheduler block of 32): the local hit (48) is a multiple of the Mamba
# block but not of the scheduler block.
LAYOUTS = {
    "blocks-of-16": ({}, 56, 44),
    "attention-blocks-of-32": ({"full_block_multiple": 2}, 72, 52),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_no_cpu_hit_continues_a_local_hit_inside_a_block(lazy, layout):
    overrides, on_the_cpu, on_the_gpu = LAYOUTS[layout]
    e = pmu_engine(lazy=lazy, **overrides)
    if lazy:
        tail_on_a_lazy_cpu_only(e, PROMPT[:on_the_cpu])
    else:
        prompt_on_the_cpu_only(e, PROMPT[:on_the_cpu])
    e.add_request(PROMPT[:on_the_gpu], max_tokens=1)
    e.run()
    req_id = e.add_request(PROMPT, max_tokens=2)
    (_, start, _), _ = first_chunk_and_loads(e, req_id)
    # The local hit is kept, or a block-aligned one superseded by a longer
    # CPU hit (0.27.0-0.29.0 start at 48 or 64 where the blocks are 16 or 32).
    assert start >= on_the_gpu // 8 * 8
    assert req_id in e.stats.finished
    assert e.runner.violations == [] and e.cuda.races == []
