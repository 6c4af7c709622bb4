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
request computes from 56: wrong KV, silently. From 0.27.0 the scheduler
hands the connector a block-aligned local hit; 0.30.0's connector also
refuses a lookup after an unaligned one. The fix does the latter.
"""

from __future__ import annotations

import pytest

from harness.mamba import prompt_on_the_cpu_only
from harness.offload_checks import first_chunk_and_loads
from harness.prefix_match_unit import pmu_engine, tail_on_a_lazy_cpu_only

PROMPT = list(range(100, 180))
ON_THE_CPU = PROMPT[:56]
# Its last hash boundary (40) lies inside attention block #2 (tokens 32-47).
ON_THE_GPU = PROMPT[:44]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_no_cpu_hit_continues_a_local_hit_inside_a_block(lazy):
    e = pmu_engine(lazy=lazy)
    if lazy:
        tail_on_a_lazy_cpu_only(e, ON_THE_CPU)
    else:
        prompt_on_the_cpu_only(e, ON_THE_CPU)
    e.add_request(ON_THE_GPU, max_tokens=1)
    e.run()
    req_id = e.add_request(PROMPT, max_tokens=2)
    (_, start, _), _ = first_chunk_and_loads(e, req_id)
    # The local hit (40) is kept, or a block-aligned one superseded by a
    # longer CPU hit (0.27.0-0.29.0 load from 32 and start at 48).
    assert start >= 40
    assert req_id in e.stats.finished
    assert e.runner.violations == [] and e.cuda.races == []
