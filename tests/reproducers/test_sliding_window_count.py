"""Reproducers for how a sliding-window group's blocks are counted at
admission.

0.19.0 and 0.19.1 (R1): the admission gate (can_fit_full_sequence, on by
default) counts a sliding-window group as if it kept a block for every
block of the prompt, but the group frees the blocks that leave the window
as chunks are allocated and never holds more than the window and one
step's tokens. A long prompt that fits the pool is refused at every step,
with nothing running to change the count: it waits forever, and every
request behind it (vllm#39734, fixed upstream in 0.20.0 by #40946).

0.20.0 and 0.20.1 (R2): a sliding-window group's block count is capped
only at admission.

0.20.0 and 0.20.1 cap the number of blocks a sliding-window (or chunked
local) group counts for a request at its per-request admission bound on
every call of get_num_blocks_to_allocate, not only in the admission gate.
A step's allocation then takes more blocks than allocate_slots counted:
with the pool nearly full it asks for blocks that are not free, and the
engine dies ("Cannot get N free blocks from the pool"; with 0001/0002, a
KVCacheCorruptionError). 0.20.2 counts the cap at admission only.

The differential oracle's generated hybrid traces hit it (mixed seeds 15
and 39 among others: the harness's guard stops a request for more blocks
than are free on an unshared pool, where the release would raise).
"""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig
from harness.trace_worker import run


@pytest.mark.parametrize("seed", [15, 39])
def test_hybrid_traces_allocate_only_what_they_counted(seed):
    record = run(seed, "mixed")
    assert record["crash"] is None, record["crash"]
    assert record["violation"] is None, record["violation"]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("offload", [False, True], ids=["no-offload", "offload"])
def test_a_hybrid_prompt_that_fits_the_pool_is_admitted(offload, async_scheduling):
    e = Engine(
        HarnessConfig(
            hybrid=True,
            sliding_window=64,
            num_gpu_blocks=64,
            offload=offload,
            async_scheduling=async_scheduling,
        )
    )
    # 33 blocks of full attention and, as chunks go by, at most 13 of the
    # window: 46 of the 63 usable blocks. Counted whole, 66.
    r = e.add_request(list(range(100, 100 + 33 * 16)), max_tokens=2)
    e.run(max_steps=100)
    assert r in e.stats.finished
    assert e.runner.violations == []
