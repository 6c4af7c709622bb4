"""Reproducer for R2 (0.20.0 and 0.20.1 only): a sliding-window group's
block count is capped only at admission.

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

from harness.trace_worker import run


@pytest.mark.parametrize("seed", [15, 39])
def test_hybrid_traces_allocate_only_what_they_counted(seed):
    record = run(seed, "mixed")
    assert record["crash"] is None, record["crash"]
    assert record["violation"] is None, record["violation"]
